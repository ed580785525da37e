"""The fused Triton layer ops on CUDA (skipped without a GPU), against the plain-torch path on
the same device, at Qwen3-0.6B's shapes in bfloat16, plus CUDA-graph capture.

The residual add is bit-equal; norms and silu are within one bfloat16 ulp with >= 99% of
elements bit-equal (the kernels' float32 reductions, rsqrt and exp are not torch's bit for bit);
q/k norm + rotary is within one bf16 rounding of torch and not bit-equal (see
test_qk_rotary_matches_torch_bf16). Under the interpreter (fused_interpret_cases.py) they are
bit-equal. Greedy tokens of tiny fp32 models with fusion on equal HF's in
tests/engine/test_cuda_engine.py (fusion is the CUDA default).
"""
import os

import pytest
import torch
import torch.nn.functional as F

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

T_DECODE, HIDDEN, INTER, HQ, HK, D = 256, 1024, 3072, 16, 8, 128


@pytest.fixture(scope="module")
def ops():
    from pagedserve.layers import fused
    fused.reset()
    mod = fused.fused_ops(torch.device("cuda"))
    if mod is None:
        if os.environ.get("PAGEDSERVE_FUSED", "1").strip().lower() in ("0", "false", "off"):
            pytest.skip("fused ops switched off (PAGEDSERVE_FUSED=0)")
        pytest.fail("fused ops unavailable on CUDA: importing pagedserve.layers.triton_fused failed (see the log)")
    return mod


def _close_bf16(actual, expected):
    torch.testing.assert_close(actual.float(), expected.float(), rtol=2 ** -7, atol=0)
    assert (actual == expected).float().mean() >= 0.99


def _norm(dim, seed):
    from pagedserve.layers.norm import RMSNorm
    norm = RMSNorm(dim, eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.1 * torch.randn(dim, generator=torch.Generator().manual_seed(seed)))
    return norm.to("cuda", torch.bfloat16)


@pytest.mark.parametrize("T", [1, 37, T_DECODE])
def test_norms_and_silu_match_torch_bf16(ops, T):
    g = torch.Generator(device="cuda").manual_seed(T)
    x = (3 * torch.randn(T, HIDDEN, device="cuda", generator=g)).bfloat16()
    res = torch.randn(T, HIDDEN, device="cuda", generator=g).bfloat16()
    norm = _norm(HIDDEN, seed=T)
    _close_bf16(ops.rms_norm(x, norm.weight, norm.eps), norm._norm(x))
    out, new_res = ops.fused_add_rms_norm(x, res, norm.weight, norm.eps)
    assert torch.equal(new_res, x + res)
    _close_bf16(out, norm._norm(x + res))
    gate_up = (2 * torch.randn(T, 2 * INTER, device="cuda", generator=g)).bfloat16()
    gate, up = gate_up.chunk(2, dim=-1)
    _close_bf16(ops.silu_and_mul(gate_up), F.silu(gate) * up)


@pytest.mark.parametrize("qk_norm", [False, True])
@pytest.mark.parametrize("rotary_dim", [D, D // 2])
def test_qk_rotary_matches_torch_bf16(ops, qk_norm, rotary_dim):
    from pagedserve.layers.rotary import RotaryEmbedding, apply_rotary
    T = T_DECODE
    g = torch.Generator(device="cuda").manual_seed(rotary_dim)
    qkv = (2 * torch.randn(T, (HQ + 2 * HK) * D, device="cuda", generator=g)).bfloat16()
    positions = torch.randint(0, 40000, (T,), device="cuda", generator=g)
    rope = RotaryEmbedding(D, {"rope_type": "default", "rope_theta": 1e6}, rotary_dim / D).cuda()
    cos, sin = rope(positions, torch.bfloat16)
    q, k, v = qkv.split([HQ * D, HK * D, HK * D], dim=-1)
    q, k = q.view(T, HQ, D), k.view(T, HK, D)
    q_norm, k_norm = _norm(D, 1), _norm(D, 2)
    ref_q, ref_k = (q_norm._norm(q), k_norm._norm(k)) if qk_norm else (q, k)
    ref_q, ref_k = apply_rotary(ref_q, cos, sin), apply_rotary(ref_k, cos, sin)
    weights = (q_norm.weight, k_norm.weight, q_norm.eps) if qk_norm else ()
    out_q, out_k = ops.qk_norm_rotary_(q, k, cos, sin, *weights)
    # Within one bf16 rounding of torch's op-by-op result (rtol 2^-7 is one bf16 ulp relative; atol
    # covers outputs near zero after the rotation's cancellation), and no bit-equality claim: on the
    # H200 at 726e751 (benchmarks/results/h200/logs/gpu_tests.log) no case was bit-equal, and with
    # qk-norm only 77.7% (rotary_dim 128) and 88.9% (64) of elements were, since a last-bit
    # difference in the norm (the GPU's rsqrt and sum order are not torch's) moves a value across a
    # bf16 rounding boundary and the rotation carries it into both halves of the pair.
    torch.testing.assert_close(out_q.float(), ref_q.float(), rtol=2 ** -7, atol=2 ** -6)
    torch.testing.assert_close(out_k.float(), ref_k.float(), rtol=2 ** -7, atol=2 ** -6)


@pytest.mark.parametrize("pool", ["bf16", "fp8", "fp8_per_head"])
@pytest.mark.parametrize("qk_norm", [False, True])
def test_rope_write_kv_is_the_rotary_then_write_kv_bf16(ops, qk_norm, pool):
    """The one-launch rotary + K/V write (attention/triton_cache.rope_write_kv) on the GPU: q, k and
    the pools bit-equal to qk_norm_rotary_ followed by write_kv (the same arithmetic, one kernel),
    fp8 pools byte for byte; slot -1 writes nothing."""
    from pagedserve.attention import triton_ops
    from pagedserve.layers.rotary import RotaryEmbedding
    T, block_size = T_DECODE, 16
    g = torch.Generator(device="cuda").manual_seed(7)
    qkv = (2 * torch.randn(T, (HQ + 2 * HK) * D, device="cuda", generator=g)).bfloat16()
    cos, sin = RotaryEmbedding(D, {"rope_type": "default", "rope_theta": 1e6}).cuda()(
        torch.randint(0, 40000, (T,), device="cuda", generator=g), torch.bfloat16)
    norms = dict(q_weight=_norm(D, 1).weight, k_weight=_norm(D, 2).weight, eps=1e-6) if qk_norm else {}
    k_cache = torch.randn(T // block_size + 4, block_size, HK, D, device="cuda", generator=g).bfloat16()
    v_cache = torch.randn_like(k_cache)
    scales = {}
    if pool != "bf16":
        k_cache, v_cache = k_cache.to(torch.float8_e4m3fn), v_cache.to(torch.float8_e4m3fn)
        n = HK if pool == "fp8_per_head" else 1
        scales = dict(k_scale=torch.linspace(0.004, 0.02, n, device="cuda"),
                      v_scale=torch.linspace(0.003, 0.01, n, device="cuda"))
    slots = torch.randperm(k_cache.shape[0] * block_size, device="cuda", generator=g)[:T]
    slots[5] = -1

    def views(t):
        q, k, v = t.split([HQ * D, HK * D, HK * D], dim=-1)
        return q.view(T, HQ, D), k.view(T, HK, D), v.view(T, HK, D)
    ref, ref_k, ref_v = qkv.clone(), k_cache.clone(), v_cache.clone()
    rq, rk, rv = views(ref)
    ops.qk_norm_rotary_(rq, rk, cos, sin, *norms.values())
    triton_ops.write_kv(rk, rv, ref_k, ref_v, slots, *scales.values())
    triton_ops.rope_write_kv(*views(qkv), cos, sin, k_cache, v_cache, slots, **norms, **scales)
    assert torch.equal(qkv, ref)
    assert torch.equal(k_cache.view(torch.uint8), ref_k.view(torch.uint8))
    assert torch.equal(v_cache.view(torch.uint8), ref_v.view(torch.uint8))


def test_fused_ops_capture_in_a_cuda_graph(ops):
    norm = _norm(HIDDEN, seed=0)
    x = torch.randn(T_DECODE, HIDDEN, device="cuda").bfloat16()
    res = torch.randn_like(x)
    gate_up = torch.randn(T_DECODE, 2 * INTER, device="cuda").bfloat16()

    def body():
        a, r = ops.fused_add_rms_norm(x, res, norm.weight, norm.eps)
        return a, r, ops.rms_norm(x, norm.weight, norm.eps), ops.silu_and_mul(gate_up)
    eager = body()  # compiles the kernels outside capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = body()
    x.copy_(torch.randn_like(x))
    graph.replay()
    for c, e in zip(captured, body()):
        assert torch.equal(c, e)
    assert not all(torch.equal(c, e) for c, e in zip(captured, eager))
