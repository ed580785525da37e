"""--generation-config (engine/generation_defaults.py): generation_config.json's sampling values
are the defaults of requests that leave them unset, offline and on the server, as vLLM takes
them; a request's own values win; `vllm` and --override-generation-config as vLLM's."""
from __future__ import annotations

import pytest

from pagedserve.config import EngineConfig
from pagedserve.demo_model import DEMO_MODEL_DIR
from pagedserve.engine.generation_defaults import generation_defaults
from pagedserve.sampling_params import SamplingParams

from .helpers import hf_greedy, make_llm, model_with_generation_config

PROMPT = "In the beginning God created"


def test_only_the_sampling_keys_the_file_sets_are_taken(tmp_path):
    m = model_with_generation_config(tmp_path, do_sample=True, temperature=0.6, top_p=0.9, top_k=20,
                                     max_new_tokens=100, num_beams=1)
    assert generation_defaults(str(m)) == {"temperature": 0.6, "top_p": 0.9, "top_k": 20, "max_tokens": 100}
    assert generation_defaults(str(DEMO_MODEL_DIR)) == {}  # its file sets token ids only
    assert generation_defaults(str(m), "vllm") == {}
    # The override applies in every mode, over the file's values.
    assert generation_defaults(str(m), "vllm", {"temperature": 0.2}) == {"temperature": 0.2}
    assert generation_defaults(str(DEMO_MODEL_DIR), "auto", {"min_p": 0.1, "max_new_tokens": 7}) == \
        {"min_p": 0.1, "max_tokens": 7}
    # A folder given by path: its file, which must be there.
    assert generation_defaults(str(DEMO_MODEL_DIR), str(m)) == generation_defaults(str(m))
    with pytest.raises(ValueError, match=r"generation_config: no generation_config\.json in"):
        generation_defaults(str(m), str(tmp_path / "nowhere"))


def test_a_bad_value_fails_when_the_config_is_made(tmp_path):
    m = model_with_generation_config(tmp_path, top_p=1.5)
    with pytest.raises(ValueError, match=r"generation_config: its sampling defaults \{'top_p': 1.5\} are not valid"):
        EngineConfig(model=str(m))
    EngineConfig(model=str(m), generation_config="vllm")  # not read at all
    with pytest.raises(ValueError, match="override_generation_config must be a JSON object"):
        EngineConfig(model=str(DEMO_MODEL_DIR), override_generation_config="temperature=0")


def test_generate_without_sampling_params_takes_the_models_defaults(tmp_path):
    """temperature 0 and max_new_tokens 6 in the file: generate(prompt) is HF's 6-token greedy."""
    m = model_with_generation_config(tmp_path, temperature=0.0, max_new_tokens=6)
    llm = make_llm(m)
    assert llm.get_default_sampling_params().temperature == 0.0
    ids = llm.get_tokenizer()(PROMPT).input_ids
    out = llm.generate({"prompt_token_ids": ids}, use_tqdm=False)[0].outputs[0]
    assert list(out.token_ids) == hf_greedy(DEMO_MODEL_DIR, ids, 6)
    # Explicit params are taken whole, as vLLM takes them: SamplingParams' own max_tokens (16).
    explicit = llm.generate({"prompt_token_ids": ids}, SamplingParams(temperature=0.0, ignore_eos=True),
                            use_tqdm=False)[0].outputs[0]
    assert len(explicit.token_ids) == 16
    # --generation-config vllm: pagedserve's defaults (temperature 1.0).
    assert make_llm(m, generation_config="vllm").get_default_sampling_params().temperature == 1.0
