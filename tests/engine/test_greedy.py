"""Greedy decoding equals HF generate(do_sample=False), token for token, whatever the memory pressure."""
import pytest

from pagedserve import SamplingParams
from tiny_models import ARCHS

from .helpers import assert_no_leak, hf_greedy, make_llm, prompt_ids

MAX_TOKENS = 12


def _check(llm, model_dir, ids, max_tokens=MAX_TOKENS, ignore_eos=False):
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=ignore_eos)
    outs = llm.generate([{"prompt_token_ids": p} for p in ids], params, use_tqdm=False)
    for p, out in zip(ids, outs):
        assert out.prompt_token_ids == p
        assert out.outputs[0].token_ids == hf_greedy(model_dir, p, max_tokens, ignore_eos), p
    assert_no_leak(llm)
    return outs


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_batch_matches_hf(tiny_model_dir, arch):
    model_dir = tiny_model_dir(arch)
    llm = make_llm(model_dir)
    _check(llm, model_dir, prompt_ids(model_dir))
