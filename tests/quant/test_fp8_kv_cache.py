"""The FP8 KV cache end to end on CPU: twice the blocks of bf16 for the same memory, swaps that move
e4m3 blocks bit-exact, prefix hits that reuse fp8 blocks and change nothing, calibrated scales,
and the cache dtype in the stats. (The kernels themselves: tests/attention/triton_interpret_cases.py.)"""
import random

import torch

from pagedserve import SamplingParams
from pagedserve.attention import Attention
from pagedserve.attention.kv_quant import FP8_KV_DTYPE
from pagedserve.config import EngineConfig
from pagedserve.entrypoints.llm import LLM
from pagedserve.models.loader import load_hf_config
from pagedserve.runner.cache_engine import CacheEngine
from pagedserve.runner.model_runner import ModelRunner


def _runner(model_dir, **kw) -> ModelRunner:
    cfg = EngineConfig(model=str(model_dir), device="cpu", dtype="bfloat16", cpu_kv_cache_gib=0.01,
                       swap_space=0.005, **kw)
    runner = ModelRunner(cfg, load_hf_config(model_dir), torch.device("cpu"), torch.bfloat16)
    runner.load_model()
    return runner


def test_fp8_pool_holds_twice_the_blocks_of_bf16_for_the_same_memory(tiny_model_dir):
    model_dir = tiny_model_dir("llama")
    bf16, fp8 = _runner(model_dir), _runner(model_dir, kv_cache_dtype="fp8")
    (g16, c16), (g8, c8) = bf16.determine_num_blocks(), fp8.determine_num_blocks()
    assert fp8.block_bytes * 2 == bf16.block_bytes
    # floor(budget / half the bytes) is 2 * floor(budget / bytes), plus one where the remainder allows
    assert g8 // 2 == g16 and c8 // 2 == c16 and g8 >= 2 * g16, (g16, g8, c16, c8)
    fp8.allocate_kv_cache(g8, c8)
    k, v = fp8.kv_caches[0]
    assert k.dtype == v.dtype == FP8_KV_DTYPE and k.shape[0] == g8
    assert fp8.cache_engine.gpu_pool.numel() * fp8.cache_engine.gpu_pool.element_size() == g8 * fp8.block_bytes


def test_swap_round_trips_fp8_blocks_bit_exact():
    ce = CacheEngine(num_layers=3, num_kv_heads=2, head_dim=8, block_size=4, num_gpu_blocks=10, num_cpu_blocks=6,
                     dtype=FP8_KV_DTYPE, device="cpu")
    gen = torch.Generator().manual_seed(0)
    ce.gpu_pool.copy_(torch.randint(0, 256, ce.gpu_pool.shape, generator=gen, dtype=torch.uint8))
    before = ce.gpu_pool.clone()
    ce.swap_out([(1, 5), (7, 0), (3, 2)])
    ce.gpu_pool[:, :, [1, 7, 3]] = 0  # the device blocks are reused by someone else
    ce.swap_in([(5, 8), (0, 4), (2, 9)])  # back, to other device blocks
    assert torch.equal(ce.gpu_pool[:, :, [8, 4, 9]], before[:, :, [1, 7, 3]])
    k0 = ce.kv_caches[0][0]
    assert k0.dtype == FP8_KV_DTYPE and torch.equal(k0[8].view(torch.uint8), before[0, 0, 1])


def _llm(model_dir, **kw) -> LLM:
    return LLM(str(model_dir), device="cpu", dtype="float32", swap_space=0.01, num_gpu_blocks_override=128,
               block_size=8, kv_cache_dtype="fp8", **kw)


def test_prefix_hits_reuse_fp8_blocks_and_change_nothing(tiny_model_dir):
    model_dir = tiny_model_dir("llama")
    rng = random.Random(0)
    prefix = [rng.randrange(3, 300) for _ in range(40)]  # five full blocks
    prompts = [prefix + [rng.randrange(3, 300) for _ in range(n)] for n in (3, 7)]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    cached = _llm(model_dir, enable_prefix_caching=True)
    first = cached.generate([{"prompt_token_ids": prompts[0]}], params)[0].outputs[0].token_ids
    second = cached.generate([{"prompt_token_ids": prompts[1]}], params)[0].outputs[0].token_ids
    stats = cached.get_kv_cache_stats()
    assert stats.cache_dtype == "fp8_e4m3"
    assert stats.prefix_cache_hits >= 40, stats
    cached.shutdown()
    fresh = _llm(model_dir, enable_prefix_caching=False)
    want = [fresh.generate([{"prompt_token_ids": p}], params)[0].outputs[0].token_ids for p in prompts]
    assert fresh.get_kv_cache_stats().prefix_cache_hits == 0
    fresh.shutdown()
    assert [list(first), list(second)] == [list(w) for w in want]


def test_calculate_kv_scales_sets_each_layer_from_its_kv(tiny_model_dir):
    model_dir = tiny_model_dir("llama")
    llm = _llm(model_dir, calculate_kv_scales=True)
    layers = [m for m in llm.llm_engine.runner.model.modules() if isinstance(m, Attention)]
    for m in layers:
        # amax * headroom / 448 of a forward's K and V: neither the default 1.0 nor zero
        assert 0 < float(m.k_scale) < 1 and 0 < float(m.v_scale) < 1, (float(m.k_scale), float(m.v_scale))
    out = llm.generate([{"prompt_token_ids": [5, 17, 99, 3, 250, 41]}],
                       SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 4
    llm.shutdown()


def test_metrics_show_the_cache_dtype():
    from pagedserve.metrics import EngineSnapshot, ServerMetrics
    m = ServerMetrics()
    m.snapshot = EngineSnapshot(cache_dtype="fp8_e4m3", num_gpu_blocks=512, block_size=16)
    m.cache_config.update(block_size="16", num_gpu_blocks="512")  # as the engine's Ready sets it
    text = m.render().decode()
    assert 'pagedserve:cache_config_info{block_size="16",cache_dtype="fp8_e4m3",num_gpu_blocks="512"} 1.0' in text
    vllm = [line for line in text.splitlines() if line.startswith("vllm:cache_config_info{")]
    assert len(vllm) == 1 and 'cache_dtype="fp8_e4m3"' in vllm[0] and 'num_gpu_blocks="512"' in vllm[0]
