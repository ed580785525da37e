"""vLLM's LLM(...) arguments a script passes out of habit: trust_remote_code runs no checkpoint
code here, so it is accepted with a warning saying so, and the model serves as without it."""
from __future__ import annotations

import logging

from pagedserve import SamplingParams

from .helpers import make_llm


def test_trust_remote_code_is_accepted_with_a_warning(tiny_model_dir, caplog):
    model = tiny_model_dir("llama")
    with caplog.at_level(logging.WARNING, logger="pagedserve.engine.llm_engine"):
        llm = make_llm(model, trust_remote_code=True)
    assert any("runs no code from the checkpoint" in r.getMessage() for r in caplog.records)
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    prompt = {"prompt_token_ids": [5, 17, 33, 101]}
    plain = make_llm(model)
    assert llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids == \
        plain.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
