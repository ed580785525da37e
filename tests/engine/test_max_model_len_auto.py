"""max_model_len -1 ("auto" on the command line, vLLM's): the longest one request the KV cache
holds, up to the model's limit, decided once the pool is sized; every later check uses it."""
import pytest

from pagedserve import SamplingParams
from pagedserve.config import MAX_MODEL_LEN_AUTO, EngineConfig
from pagedserve.engine.preflight import check_engine_config

from .helpers import hf_greedy, make_llm


def test_auto_fits_the_kv_cache_and_refuses_what_it_cannot_hold(tiny_model_dir):
    model_dir = tiny_model_dir("llama")  # its limit: 512 positions
    llm = make_llm(model_dir, max_model_len=MAX_MODEL_LEN_AUTO, num_gpu_blocks_override=12, block_size=16)
    engine = llm.llm_engine
    assert engine.max_model_len == 192 == engine.scheduler_config.max_model_len  # 12 blocks x 16
    prompt = list(range(3, 180))
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
    assert out.outputs[0].token_ids == hf_greedy(model_dir, prompt, 12, ignore_eos=True)
    with pytest.raises(ValueError, match="192"):  # 185 + 8 > 192: the fitted length is the limit
        llm.generate([{"prompt_token_ids": list(range(3, 188))}], SamplingParams(max_tokens=8), use_tqdm=False)


def test_auto_keeps_the_model_limit_when_the_cache_holds_more(tiny_model_dir):
    llm = make_llm(tiny_model_dir("llama"), max_model_len=MAX_MODEL_LEN_AUTO, num_gpu_blocks_override=64,
                   block_size=16)
    assert llm.llm_engine.max_model_len == 512


def test_auto_passes_the_preflight_and_other_negatives_do_not(tiny_model_dir):
    check_engine_config(EngineConfig(model=str(tiny_model_dir("llama")), max_model_len=-1, device="cpu"))
    with pytest.raises(ValueError, match="or -1 .auto"):
        EngineConfig(max_model_len=-2)
