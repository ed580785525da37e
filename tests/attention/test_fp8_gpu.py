"""FP8 on the GPU (skipped without CUDA; the H200 run records them): torch._scaled_mm against the
dequantized product, the FP8 KV kernels at Llama-3.1-8B attention sizes (per-tensor and per-KV-head
scales; the fp8 decode's launch variants, in a CUDA graph too) against attention over dequantized K/V,
and the demo model end to end, bf16 against FP8 weights and KV."""
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from pagedserve.attention import reference
from pagedserve.attention.kv_quant import quantize_kv
from pagedserve.layers.quant.fp8_ops import dequantize, fp8_gemm, quantize_per_channel, quantize_per_token
from paged_batch import make_batch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
DEMO = Path(__file__).resolve().parents[2] / "pagedserve" / "demo_model"


@pytest.mark.parametrize("M,K,N", [(1, 4096, 6144), (37, 4096, 28672), (256, 14336, 4096)])
def test_scaled_mm_matches_dequantized_product(M, K, N):
    gen = torch.Generator(device="cuda").manual_seed(M)
    x = torch.randn(M, K, device="cuda", generator=gen, dtype=torch.bfloat16)
    w = torch.randn(N, K, device="cuda", generator=gen, dtype=torch.bfloat16) * 0.02
    xq, xs = quantize_per_token(x)
    wq, ws = quantize_per_channel(w)
    y = fp8_gemm(xq, xs, wq, ws, torch.bfloat16)
    want = dequantize(xq, xs) @ dequantize(wq, ws[:, None]).t()
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y.float(), want, rtol=2e-2, atol=2e-2 * want.abs().mean().item())


def _written_fp8_pools(batch, ks, vs):
    """The batch's pools quantized with (ks, vs), then its new K/V written by the Triton kernel,
    whose bytes must equal the reference write's."""
    from pagedserve.attention import triton_ops as ops
    kc, vc = quantize_kv(batch.k_cache, ks), quantize_kv(batch.v_cache, vs)
    rk, rv = kc.clone(), vc.clone()
    reference.write_kv(batch.new_k, batch.new_v, rk, rv, batch.meta.slot_mapping, ks, vs)
    ops.write_kv(batch.new_k, batch.new_v, kc, vc, batch.meta.slot_mapping, ks, vs)
    assert torch.equal(kc.view(torch.uint8), rk.view(torch.uint8))
    assert torch.equal(vc.view(torch.uint8), rv.view(torch.uint8))
    return kc, vc


def test_fp8_kv_kernels_at_llama_sizes():
    from pagedserve.attention import triton_ops as ops
    shapes = [(300, 1), (1500, 1), (0, 1), (2000, 1), (0, 97), (517, 64)]
    batch = make_batch(shapes, 4, H=32, Hkv=8, D=128, block_size=16, dtype=torch.bfloat16, device="cuda", seed=2)
    ks, vs = torch.tensor([0.01], device="cuda"), torch.tensor([0.008], device="cuda")
    kc, vc = _written_fp8_pools(batch, ks, vs)
    ref = reference.paged_attention(batch.query, kc.float() * ks, vc.float() * vs, batch.meta, 128 ** -0.5)
    for splits in (None, 1, 4):
        out = ops.paged_attention(batch.query, kc, vc, batch.meta, 128 ** -0.5, num_splits=splits,
                                  k_scale=ks, v_scale=vs)
        torch.testing.assert_close(out.float(), ref.float(), rtol=2e-2, atol=2e-2)


def test_fp8_per_head_kv_kernels_at_llama_sizes():
    """[num_kv_heads] scales 100x apart: the cache write bit-exact against quantize_kv, and the
    decode (split-K too), prefill and unified kernels against attention over K/V dequantized with
    each head's scale."""
    from dataclasses import replace
    from pagedserve.attention import triton_ops as ops
    shapes = [(300, 1), (1500, 1), (0, 1), (2000, 1), (0, 97), (517, 64)]
    batch = make_batch(shapes, 4, H=32, Hkv=8, D=128, block_size=16, dtype=torch.bfloat16, device="cuda", seed=6)
    ks = torch.logspace(-3, -1, 8, device="cuda")
    vs = ks.flip(0) * 0.8
    kc, vc = _written_fp8_pools(batch, ks, vs)
    ref = reference.paged_attention(batch.query, kc.float() * ks[:, None], vc.float() * vs[:, None], batch.meta,
                                    128 ** -0.5)
    for splits in (None, 1, 4):
        out = ops.paged_attention(batch.query, kc, vc, batch.meta, 128 ** -0.5, num_splits=splits,
                                  k_scale=ks, v_scale=vs)
        torch.testing.assert_close(out.float(), ref.float(), rtol=2e-2, atol=2e-2)
    out = ops.unified_paged_attention(batch.query, kc, vc, replace(batch.meta, unified_work=None), 128 ** -0.5,
                                      k_scale=ks, v_scale=vs)
    torch.testing.assert_close(out.float(), ref.float(), rtol=2e-2, atol=2e-2)


# The fp8 decode launch variants benchmarks/kernels/fp8_decode_sweep.py times (DECODE_FP8_LAUNCH's names).
FP8_DECODE_VARIANTS = ["base", "f16", "bn256", "bn256+f16", "bn256+w8", "bn256+w8+f16", "bn256+w8+s2+f16",
                       "bn64+s4+f16"]


def _fp8_decodes(seed):
    """Five decodes at Llama-3.1-8B attention sizes (one of 4096 positions), per-KV-head scales 100x
    apart, bf16 queries; and the reference over K/V dequantized with each head's scale."""
    shapes = [(300, 1), (1500, 1), (0, 1), (2000, 1), (4095, 1)]
    batch = make_batch(shapes, 5, H=32, Hkv=8, D=128, block_size=16, dtype=torch.bfloat16, device="cuda", seed=seed)
    ks = torch.logspace(-3, -1, 8, device="cuda")
    vs = ks.flip(0) * 0.8
    kc, vc = quantize_kv(batch.k_cache, ks), quantize_kv(batch.v_cache, vs)
    from pagedserve.attention import triton_ops as ops
    ops.write_kv(batch.new_k, batch.new_v, kc, vc, batch.meta.slot_mapping, ks, vs)
    ref = reference.paged_attention(batch.query, kc.float() * ks[:, None], vc.float() * vs[:, None], batch.meta,
                                    128 ** -0.5)
    return batch, kc, vc, ks, vs, ref


@pytest.mark.parametrize("variant", FP8_DECODE_VARIANTS)
def test_fp8_decode_launch_variants_at_llama_sizes(variant):
    """Each fp8 decode launch (BLOCK_N, warps, stages, the f16 cast) against attention over the
    dequantized K/V, one split, four, and the default's, programs longest first."""
    from triton.runtime.errors import OutOfResources
    from pagedserve.attention import decode_plan, triton_ops as ops
    launch = decode_plan.parse_decode_launch(variant, fp8=True)
    batch, kc, vc, ks, vs, ref = _fp8_decodes(seed=7)
    m = batch.meta
    for splits in (None, 1, 4):
        out = torch.empty_like(batch.query)
        try:
            ops.paged_decode(batch.query, kc, vc, m.seq_lens, m.block_tables, m.max_seq_len, 128 ** -0.5, out,
                             num_splits=splits, block_n=launch.block_n, num_warps=launch.num_warps,
                             num_stages=launch.num_stages, f16_dot=launch.f16_dot,
                             order=ops.longest_first(m.seq_lens), k_scale=ks, v_scale=vs)
        except OutOfResources as e:  # a launch this GPU cannot take can never be the default: say so
            pytest.skip(f"{variant} does not fit this GPU: {e}")
        torch.testing.assert_close(out.float(), ref.float(), rtol=2e-2, atol=2e-2)


def test_fp8_decode_launch_in_a_cuda_graph(monkeypatch):
    """paged_attention with an fp8 launch of its own (BLOCK_N 256, 8 warps, 2 stages, the f16 cast) captured
    as a decode graph captures it (balanced split mode), replayed on new queries and lengths."""
    from dataclasses import replace
    from pagedserve.attention import decode_plan, triton_ops as ops
    monkeypatch.setattr(decode_plan, "fp8_decode_launch_settings",
                        lambda: decode_plan.parse_decode_launch("bn256+w8+s2+f16", fp8=True))
    batch, kc, vc, ks, vs, _ = _fp8_decodes(seed=8)
    q = batch.query.clone()
    seq_lens = batch.meta.seq_lens.clone()
    meta = lambda: replace(batch.meta, seq_lens=seq_lens, seq_lens_cpu=None,  # noqa: E731
                           decode_split_tokens=decode_plan.BALANCED, decode_order=None)
    ops.paged_attention(q, kc, vc, meta(), 128 ** -0.5, k_scale=ks, v_scale=vs)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = ops.paged_attention(q, kc, vc, meta(), 128 ** -0.5, k_scale=ks, v_scale=vs)
    gen = torch.Generator(device="cuda").manual_seed(3)
    for shorter in (0, 700):
        q.copy_(torch.randn(q.shape, device="cuda", generator=gen, dtype=torch.float32).to(q.dtype))
        seq_lens.copy_((batch.meta.seq_lens - shorter).clamp(min=1))
        graph.replay()
        want_meta = replace(batch.meta, seq_lens=seq_lens.clone(), seq_lens_cpu=seq_lens.tolist())
        ref = reference.paged_attention(q, kc.float() * ks[:, None], vc.float() * vs[:, None], want_meta, 128 ** -0.5)
        torch.testing.assert_close(out.float(), ref.float(), rtol=2e-2, atol=2e-2)


def _perplexity(llm_kwargs) -> float:
    from transformers import AutoTokenizer
    from pagedserve import SamplingParams
    from pagedserve.entrypoints.llm import LLM
    tok = AutoTokenizer.from_pretrained(DEMO)
    text = (DEMO / "heldout.txt").read_text().strip("\n").split("\n\n")[:3]
    prompts = [tok(c).input_ids[:512] for c in text]
    llm = LLM(str(DEMO), dtype="bfloat16", **llm_kwargs)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(max_tokens=1, prompt_logprobs=0))
    llm.shutdown()
    nll = [-lp[t].logprob for o, p in zip(outs, prompts) for lp, t in zip(o.prompt_logprobs[1:], p[1:])]
    return math.exp(sum(nll) / len(nll))


def test_demo_model_perplexity_bf16_vs_fp8_within_2pct():
    base = _perplexity({})
    for kw in ({"quantization": "fp8"}, {"kv_cache_dtype": "fp8", "calculate_kv_scales": True},
               {"kv_cache_dtype": "fp8", "calculate_kv_scales": True, "kv_cache_scale_strategy": "attn_head"},
               {"quantization": "fp8", "kv_cache_dtype": "fp8"}):
        ppl = _perplexity(kw)
        assert abs(ppl / base - 1) <= 0.02, (kw, ppl, base)


@pytest.mark.parametrize("kv_scales", [{}, {"calculate_kv_scales": True, "kv_cache_scale_strategy": "attn_head"}],
                         ids=["kv-scales-1.0", "kv-scales-per-head"])
def test_fp8_graphs_match_eager_on_the_demo_model(kv_scales):
    """Per head too: the warm-up and the graphs then compile and capture the per-head kernels."""
    from pagedserve import SamplingParams
    from pagedserve.entrypoints.llm import LLM
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    prompts = [{"prompt_token_ids": list(range(3, 3 + n))} for n in (5, 40, 130)]
    got = {}
    for eager in (True, False):
        # A fixed pool: the memory profile after the other GPU tests in this process found no room
        # (the H200 run at f66e8cc).
        llm = LLM(str(DEMO), dtype="bfloat16", quantization="fp8", kv_cache_dtype="fp8", enforce_eager=eager,
                  num_gpu_blocks_override=512, **kv_scales)
        got[eager] = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params)]
        llm.shutdown()
    assert got[True] == got[False]


def test_triton_per_token_quant_matches_torch():
    """Not bit-equal on the H200 (the run at f66e8cc found the scales apart in their last bits):
    each scale within 1e-5 of torch's, relative, and a quantized value off by at most one e4m3
    step, rarely."""
    from pagedserve.layers.quant.fp8_ops import quantize_per_token_torch
    from pagedserve.layers.quant.triton_fp8 import quantize_per_token as triton_quant
    x = torch.randn(300, 14336, device="cuda", dtype=torch.bfloat16) * 3
    q, s = triton_quant(x)
    rq, rs = quantize_per_token_torch(x)
    torch.testing.assert_close(s, rs, rtol=1e-5, atol=0)
    a, b = q.float(), rq.float()
    step = torch.maximum(a.abs(), b.abs()) / 8  # e4m3 has 3 mantissa bits: one step is <= |v| / 8
    assert ((a - b).abs() <= step + 2.0**-9).all()
    assert (a != b).float().mean() < 1e-2
