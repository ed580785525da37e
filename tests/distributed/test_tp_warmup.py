"""The start-up warm-up under tensor parallelism (gloo on CPU): every rank runs it as its own
start-up phase (the same synthetic forwards, so the same collectives), and afterwards the
engine generates exactly what a single-rank engine without the warm-up generates."""
import pytest
import torch

from pagedserve import LLM
from pagedserve.runner.warmup import WARMUP_ENV
from tp_helpers import PROMPTS, assert_same_greedy, greedy

KW = dict(device="cpu", block_size=8, max_num_batched_tokens=32, max_num_seqs=4, num_gpu_blocks_override=40,
          swap_space=1 / 1024)


@pytest.mark.timeout(240)
def test_tp2_warms_up_on_every_rank_and_keeps_outputs(tiny_model_dir, monkeypatch):
    model = str(tiny_model_dir("llama"))
    monkeypatch.setenv(WARMUP_ENV, "0")
    ref = LLM(model, **KW)
    try:
        want = greedy(ref, PROMPTS, 8)
    finally:
        ref.shutdown()
    monkeypatch.setenv(WARMUP_ENV, "1")  # the worker processes inherit it
    llm = LLM(model, **KW, tensor_parallel_size=2)
    try:
        runner = llm.llm_engine.runner.runner  # rank 0's own ModelRunner
        assert runner.profile["warmup_seconds"] > 0
        assert torch.count_nonzero(runner.cache_engine.gpu_pool) == 0
        assert llm.get_kv_cache_stats().num_blocks_free == KW["num_gpu_blocks_override"]
        assert_same_greedy(want, greedy(llm, PROMPTS, 8))
    finally:
        llm.shutdown()
