"""Cases for the fused layer kernels under the Triton interpreter (CPU), against the torch path.

Not collected on its own: test_fused_interpret.py runs this file in a subprocess with
TRITON_INTERPRET=1 (Triton picks interpreter-or-compiler at import time).

Tolerances, and why:
- float32: allclose at 1e-5; the kernels' sums of squares and exp are not torch's, bit for bit.
- bfloat16, no reduction or transcendental in between (the residual add; rotary without
  q/k norm): bit-equal, because the kernels round to bfloat16 exactly where torch does.
- bfloat16 norms and silu: within one bfloat16 ulp (rtol 2**-7), and >= 99% of the elements
  bit-equal: a last-bit float32 difference in the reduction or exp can flip one rounding.
- bfloat16 q/k norm + rotary: a flipped norm rounding is carried through the rotation
  (a difference of two rounded products), so atol 2**-6 on unit-scale values, >= 99% bit-equal.
- FP8 out (the norms and silu with the per-token quantization fused in): bit-equal (q bytes and
  scales) to the same op's kernel followed by the per-token quant kernel, and so to the op's kernel
  followed by the torch quant (bit-equal to that kernel here). Against the torch op then the torch
  quant they inherit the op's difference: the scale within one ulp of the dtype (its amax may move
  by one), each dequantized value within one e4m3 step (|v| / 8, or the subnormal step
  scale * 2**-9) of the reference's, and >= 99% of the fp8 bytes equal.
"""
import os

import pytest
import torch
import torch.nn.functional as F

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("run through test_fused_interpret.py (needs TRITON_INTERPRET=1 before importing triton)",
                allow_module_level=True)

from interpreter_fixes import apply as _fix_interpreter  # noqa: E402

_fix_interpreter()

from triton.runtime import interpreter  # noqa: E402

from pagedserve.layers import fused  # noqa: E402
from pagedserve.layers import triton_fused as ops  # noqa: E402
from pagedserve.layers.norm import RMSNorm  # noqa: E402
from pagedserve.layers.rotary import RotaryEmbedding, apply_rotary  # noqa: E402

DTYPES = [torch.float32, torch.bfloat16]


def _check(actual, expected, exact_in_bf16: bool, bf16_atol: float = 0.0):
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    if expected.dtype == torch.float32:
        torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5)
    elif exact_in_bf16:
        assert torch.equal(actual, expected), (actual.float() - expected.float()).abs().max()
    else:
        torch.testing.assert_close(actual.float(), expected.float(), rtol=2 ** -7, atol=bf16_atol)
        assert (actual == expected).float().mean() >= 0.99


def _norm(dim, dtype, seed):
    norm = RMSNorm(dim, eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.1 * torch.randn(dim, generator=torch.Generator().manual_seed(seed)))
    return norm.to(dtype)


def test_kernels_are_interpreted_and_torch_path_is_default_on_cpu():
    assert isinstance(ops._rms_norm_kernel, interpreter.InterpretedFunction)
    assert fused.fused_ops(torch.device("cpu")) is None


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T,H", [(1, 64), (37, 96), (5, 1000)])
def test_rms_norm_and_fused_add(dtype, T, H):
    g = torch.Generator().manual_seed(T * H)
    x = (3 * torch.randn(T, H, generator=g)).to(dtype)
    res = torch.randn(T, H, generator=g).to(dtype)
    norm = _norm(H, dtype, seed=H)
    _check(ops.rms_norm(x, norm.weight, norm.eps), norm(x), exact_in_bf16=False)
    out, new_res = ops.fused_add_rms_norm(x, res, norm.weight, norm.eps)
    ref_out, ref_res = norm(x, res)
    assert torch.equal(new_res, ref_res)  # the add is rounded once, as torch's add: bit-equal in any dtype
    _check(out, ref_out, exact_in_bf16=False)


def test_fused_add_leaves_inputs_alone_and_handles_3d():
    x, res = torch.randn(2, 3, 40).bfloat16(), torch.randn(2, 3, 40).bfloat16()
    x0, res0 = x.clone(), res.clone()
    norm = _norm(40, torch.bfloat16, seed=1)
    out, new_res = ops.fused_add_rms_norm(x, res, norm.weight, norm.eps)
    assert torch.equal(x, x0) and torch.equal(res, res0)
    assert out.shape == new_res.shape == (2, 3, 40) and torch.equal(new_res, x + res)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T,inter", [(1, 48), (37, 200), (3, 1500)])
def test_silu_and_mul(dtype, T, inter):
    gate_up = (2 * torch.randn(T, 2 * inter, generator=torch.Generator().manual_seed(inter))).to(dtype)
    gate, up = gate_up.chunk(2, dim=-1)
    _check(ops.silu_and_mul(gate_up), F.silu(gate) * up, exact_in_bf16=False)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T,Hq,Hk,D,rd,qk_norm", [
    (1, 4, 2, 16, 16, False), (37, 4, 2, 16, 16, False), (37, 4, 2, 32, 32, True),   # plain; Qwen3 qk-norm
    (5, 6, 2, 24, 24, True),                                                          # head_dim not a power of 2
    (3, 2, 1, 40, 12, False), (4, 4, 4, 32, 16, True),                                # partial rotary
    (3, 12, 4, 16, 16, True), (2, 20, 4, 16, 16, False),                              # q heads over a program's
])
def test_qk_norm_rotary_in_place_on_qkv_views(dtype, T, Hq, Hk, D, rd, qk_norm):
    g = torch.Generator().manual_seed(T + D + rd)
    qkv = (2 * torch.randn(T, (Hq + 2 * Hk) * D, generator=g)).to(dtype)
    positions = torch.randint(0, 4000, (T,), generator=g)
    rope = RotaryEmbedding(D, {"rope_type": "default", "rope_theta": 1e6}, partial_rotary_factor=rd / D)
    cos, sin = rope(positions, dtype)
    assert cos.shape == (T, 1, rd)
    q, k, v = qkv.split([Hq * D, Hk * D, Hk * D], dim=-1)
    q, k = q.view(T, Hq, D), k.view(T, Hk, D)
    q_norm, k_norm = (_norm(D, dtype, seed=2), _norm(D, dtype, seed=3)) if qk_norm else (None, None)
    ref_q, ref_k = (q_norm(q), k_norm(k)) if qk_norm else (q, k)
    ref_q, ref_k = apply_rotary(ref_q, cos, sin), apply_rotary(ref_k, cos, sin)
    v_before = v.clone()
    weights = (q_norm.weight, k_norm.weight, q_norm.eps) if qk_norm else ()
    out_q, out_k = ops.qk_norm_rotary_(q, k, cos, sin, *weights)
    assert out_q.data_ptr() == qkv.data_ptr() and out_k.data_ptr() == k.data_ptr()  # in place, same views
    assert torch.equal(v, v_before)
    _check(out_q, ref_q, exact_in_bf16=not qk_norm, bf16_atol=2 ** -6)
    _check(out_k, ref_k, exact_in_bf16=not qk_norm, bf16_atol=2 ** -6)


def test_qk_norm_rotary_rejects_odd_rotary_dim():
    q, k = torch.randn(2, 2, 16), torch.randn(2, 1, 16)
    with pytest.raises(ValueError, match="rotary_dim"):
        ops.qk_norm_rotary_(q, k, torch.randn(2, 1, 7), torch.randn(2, 1, 7))


def _prompt_logits(model_dir, **engine_args) -> torch.Tensor:
    """The last-position logits of three prompts of a tiny model, one step through the runner."""
    from pagedserve.core.plan import SchedulerOutput
    from paged_harness import HandDriver, make_runner
    driver = HandDriver(make_runner(model_dir, block_size=4, **engine_args), seed=0)
    seqs = [driver.add(p) for p in ([5, 17, 33, 101, 7], [9], list(range(3, 30)))]
    return driver.runner.execute(SchedulerOutput(scheduled=[driver.schedule(s) for s in seqs]))


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_whole_model_fused_equals_torch(tiny_model_dir, arch, monkeypatch):
    """A tiny model's prompt logits with every fused op forced on (interpreted) equal the torch path's."""
    def logits():
        return _prompt_logits(tiny_model_dir(arch))

    expected = logits()
    monkeypatch.setenv("PAGEDSERVE_FUSED", "force")
    fused.reset()
    try:
        assert fused.fused_ops(torch.device("cpu")) is ops
        actual = logits()
    finally:
        monkeypatch.delenv("PAGEDSERVE_FUSED")
        fused.reset()
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", DTYPES)
def test_per_token_fp8_quant_kernel_is_bit_equal_to_torch(dtype):
    from pagedserve.layers.quant import triton_fp8
    from pagedserve.layers.quant.fp8_ops import quantize_per_token_torch
    gen = torch.Generator().manual_seed(4)
    x = (torch.randn(5, 80, generator=gen) * torch.logspace(-4, 2, 5)[:, None]).to(dtype)
    x[3] = 0.0  # a zero row keeps the floor scale
    q, s = triton_fp8.quantize_per_token(x)
    rq, rs = quantize_per_token_torch(x)
    assert torch.equal(s, rs)
    assert torch.equal(q.view(torch.uint8), rq.view(torch.uint8))
    # rows longer than the kernel's block (K > 4096 on the GPU) walk it in chunks: the same bits
    q2, s2 = torch.empty_like(q), torch.empty_like(s)
    triton_fp8.per_token_fp8_kernel[(5,)](x, q2, s2, x.stride(0), q2.stride(0), 80, FP8_MAX=448.0,
                                          MIN_SCALE=triton_fp8.MIN_SCALE, BLOCK=32)
    assert torch.equal(s2, rs) and torch.equal(q2.view(torch.uint8), rq.view(torch.uint8))


def _check_fp8(q, scale, ref_q, ref_scale, dtype):
    """(q, scale) against the torch reference's, within the tolerances stated at the top."""
    assert q.dtype == ref_q.dtype == torch.float8_e4m3fn and q.shape == ref_q.shape
    assert scale.dtype == torch.float32 and scale.shape == ref_scale.shape == (q.reshape(-1, q.shape[-1]).shape[0], 1)
    torch.testing.assert_close(scale, ref_scale, rtol=1e-5 if dtype == torch.float32 else 2 ** -7, atol=0)
    a = q.reshape(scale.shape[0], q.shape[-1]).float() * scale
    b = ref_q.reshape(scale.shape[0], q.shape[-1]).float() * ref_scale
    step = torch.maximum(a.abs(), b.abs()) / 8 + torch.maximum(scale, ref_scale) * 2.0 ** -9
    assert ((a - b).abs() <= step).all()
    if q.numel():
        assert (q.view(torch.uint8) == ref_q.view(torch.uint8)).float().mean() >= 0.99


def _triton_quant(y):
    from pagedserve.layers.quant import triton_fp8
    return triton_fp8.quantize_per_token(y.reshape(-1, y.shape[-1]))


def _same_bits(q, scale, ref_q, ref_scale):
    assert torch.equal(scale, ref_scale)
    assert torch.equal(q.view(torch.uint8).reshape(ref_q.shape), ref_q.view(torch.uint8))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T,H", [(0, 64), (1, 64), (6, 77), (5, 1000)])  # zero rows, odd hidden sizes
def test_fp8_out_rms_norms_match_norm_then_quant(dtype, T, H):
    from pagedserve.layers.quant.fp8_ops import quantize_activation
    g = torch.Generator().manual_seed(T * H + 1)
    x = (3 * torch.randn(T, H, generator=g) * torch.logspace(-3, 1, max(T, 1))[:T, None]).to(dtype)
    res = torch.randn(T, H, generator=g).to(dtype)
    if T > 2:
        x[2], res[2] = 0.0, 0.0  # an all-zero row: the floor scale, zeros out
    norm = _norm(H, dtype, seed=H)
    q, scale = ops.rms_norm_fp8(x, norm.weight, norm.eps)
    _same_bits(q, scale, *_triton_quant(ops.rms_norm(x, norm.weight, norm.eps)))
    norm.fp8_out = True  # the torch path: norm, then fp8_ops.quantize_per_token (torch ops on CPU)
    ref = norm(x)
    _check_fp8(q, scale, ref.q, ref.scale, dtype)
    q, scale, new_res = ops.fused_add_rms_norm_fp8(x, res, norm.weight, norm.eps)
    ref, ref_res = norm(x, res)
    assert torch.equal(new_res, ref_res)
    _same_bits(q, scale, *_triton_quant(ops.fused_add_rms_norm(x, res, norm.weight, norm.eps)[0]))
    _check_fp8(q, scale, ref.q, ref.scale, dtype)
    if T > 2:
        assert scale[2].item() == quantize_activation(torch.zeros(1, H)).scale.item()
        assert not q[2].float().any()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T,inter", [(0, 48), (1, 48), (5, 37), (3, 300)])
def test_fp8_out_silu_and_mul_matches_silu_then_quant(dtype, T, inter):
    from pagedserve.layers.activation import silu_and_mul
    gate_up = (2 * torch.randn(T, 2 * inter, generator=torch.Generator().manual_seed(inter))).to(dtype)
    if T > 2:
        gate_up[1] = 0.0
    q, scale = ops.silu_and_mul_fp8(gate_up)
    assert q.shape == (T, inter)
    _same_bits(q, scale, *_triton_quant(ops.silu_and_mul(gate_up)))
    ref = silu_and_mul(gate_up, fp8_out=True)  # torch on CPU: F.silu(gate) * up, then the torch quant
    _check_fp8(q, scale, ref.q, ref.scale, dtype)
    # a row longer than the kernel's block (past 16k features) is walked twice in chunks: the same bits
    if T:
        q2, s2 = torch.empty_like(q), torch.empty_like(scale)
        ops._silu_and_mul_fp8_kernel[(T,)](gate_up, q2, s2, gate_up.stride(0), q2.stride(0), inter,
                                           FP8_MAX=448.0, MIN_SCALE=ops.MIN_SCALE, BLOCK=16, ONE_PASS=False)
        _same_bits(q2, s2, q, scale)


def test_fp8_model_same_logits_with_activation_fusion_on_and_off(tiny_model_dir, monkeypatch):
    """--quantization fp8 on a tiny Llama with the Triton layer ops forced on (interpreted): prompt
    logits with the activation quantization fused into the norms' and SiLU-and-mul's kernels equal,
    exactly, those of the separate kernels with a quantize before every FP8 GEMM (the torch path's
    twin: tests/quant/test_fp8_linear.py)."""
    from pagedserve.core.plan import SchedulerOutput
    from pagedserve.layers.quant.fusion import FUSE_ENV
    from paged_harness import HandDriver, make_runner

    prompts = [[5, 17, 33, 101, 7, 250, 3], [9]]

    def logits(fuse: str):
        monkeypatch.setenv(FUSE_ENV, fuse)
        runner = make_runner(tiny_model_dir("llama"), block_size=4, quantization="fp8")
        layer = runner.model.model.layers[0]
        assert layer.input_layernorm.fp8_out == layer.post_attention_layernorm.fp8_out == layer.mlp.fp8_act \
            == (fuse == "1")
        driver = HandDriver(runner, seed=0)
        seqs = [driver.add(p) for p in prompts]
        return driver.runner.execute(SchedulerOutput(scheduled=[driver.schedule(s) for s in seqs]))

    monkeypatch.setenv("PAGEDSERVE_FUSED", "force")
    fused.reset()
    try:
        assert fused.fused_ops(torch.device("cpu")) is ops
        off, on = logits("0"), logits("1")
    finally:
        monkeypatch.delenv("PAGEDSERVE_FUSED")
        fused.reset()
    assert torch.equal(on, off)


def _one_launch_and_two(dtype, T, Hq, Hk, D, rd, qk_norm, g, k_cache, v_cache, slots, write_kv, **scales):
    """rope_write_kv on a random fused qkv and the pools, and qk_norm_rotary_ then write_kv on
    copies: ((qkv, its reference), (K pool, reference), (V pool, reference))."""
    from pagedserve.attention import triton_ops
    qkv = (4 * torch.randn(T, (Hq + 2 * Hk) * D, generator=g)).to(dtype)
    cos, sin = RotaryEmbedding(D, {"rope_type": "default", "rope_theta": 1e6}, partial_rotary_factor=rd / D)(
        torch.randint(0, 4000, (T,), generator=g), dtype)
    norms = (_norm(D, dtype, seed=2), _norm(D, dtype, seed=3)) if qk_norm else None
    weights = dict(q_weight=norms[0].weight, k_weight=norms[1].weight, eps=norms[0].eps) if qk_norm else {}

    def views(t):
        q, k, v = t.split([Hq * D, Hk * D, Hk * D], dim=-1)
        return q.view(T, Hq, D), k.view(T, Hk, D), v.view(T, Hk, D)

    ref, ref_k, ref_v = qkv.clone(), k_cache.clone(), v_cache.clone()
    rq, rk, rv = views(ref)
    ops.qk_norm_rotary_(rq, rk, cos, sin, *weights.values())
    write_kv(rk, rv, ref_k, ref_v, slots, *scales.values())
    triton_ops.rope_write_kv(*views(qkv), cos, sin, k_cache, v_cache, slots, **weights, **scales)
    return (qkv, ref), (k_cache, ref_k), (v_cache, ref_v)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T,Hq,Hk,D,rd,qk_norm,block_size", [
    (1, 4, 2, 16, 16, False, 16), (37, 4, 2, 16, 16, False, 4), (37, 4, 2, 32, 32, True, 8),
    (5, 6, 2, 24, 24, True, 1), (3, 2, 1, 40, 12, False, 2), (4, 4, 4, 32, 16, True, 16),
    (3, 12, 4, 16, 16, True, 4), (2, 20, 4, 16, 16, False, 8),
])
def test_rope_write_kv_is_the_rotary_then_write_kv(dtype, T, Hq, Hk, D, rd, qk_norm, block_size):
    """attention/triton_cache.rope_write_kv (one launch) leaves q and k exactly as qk_norm_rotary_
    does and the pools exactly as the reference write_kv of that k and v does, slot -1 untouched."""
    from pagedserve.attention import reference, triton_ops
    g = torch.Generator().manual_seed(T * 7 + D + rd + block_size)
    num_blocks = (T + 2) // block_size + 2
    k_cache = torch.randn(num_blocks, block_size, Hk, D, generator=g).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, Hk, D, generator=g).to(dtype)
    slots = torch.randperm(num_blocks * block_size, generator=g)[:T]
    slots[T // 2] = -1  # a padded row: rotated, but nothing written
    for got, want in _one_launch_and_two(dtype, T, Hq, Hk, D, rd, qk_norm, g, k_cache, v_cache, slots,
                                         reference.write_kv):
        assert torch.equal(got, want)  # q and k rotated in place, v as it was; the pools' rows
    q = torch.zeros(T, Hq, D, dtype=dtype)
    with pytest.raises(ValueError, match="activations' dtype"):
        triton_ops.rope_write_kv(q, q[:, :Hk], q[:, :Hk], torch.zeros(T, 1, rd, dtype=dtype),
                                 torch.zeros(T, 1, rd, dtype=dtype), k_cache.to(torch.float16),
                                 v_cache.to(torch.float16), slots)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("per_head", [False, True])
@pytest.mark.parametrize("D,rd,qk_norm", [(16, 16, False), (32, 32, True), (40, 12, False), (32, 16, True)])
def test_rope_write_kv_into_fp8_pools_writes_write_kvs_bytes(dtype, per_head, D, rd, qk_norm):
    """An fp8 pool (scales per tensor or per KV head): the one launch leaves q, k and the e4m3
    bytes exactly as qk_norm_rotary_ then the Triton write_kv (itself torch's bytes, in
    attention/triton_interpret_cases.py); scales that saturate some values and make others
    subnormal."""
    from pagedserve.attention import triton_ops
    from pagedserve.attention.kv_quant import FP8_KV_DTYPE
    T, Hq, Hk, block_size = 9, 4, 2, 4
    g = torch.Generator().manual_seed(D + rd + per_head)
    scales = dict(k_scale=torch.tensor([0.01, 0.002]) if per_head else torch.tensor([0.006]),
                  v_scale=torch.tensor([0.004, 0.03]) if per_head else torch.tensor([0.002]))
    k_cache = torch.randn(6, block_size, Hk, D, generator=g).to(FP8_KV_DTYPE)
    v_cache = torch.randn(6, block_size, Hk, D, generator=g).to(FP8_KV_DTYPE)
    slots = torch.randperm(6 * block_size, generator=g)[:T]
    slots[3] = -1
    (qkv, ref), *pools = _one_launch_and_two(dtype, T, Hq, Hk, D, rd, qk_norm, g, k_cache, v_cache, slots,
                                             triton_ops.write_kv, **scales)
    assert torch.equal(qkv, ref)
    for got, want in pools:
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    assert sum((want.float().abs() == 448).sum() for _, want in pools) > 0  # the scales reach the clamp


@pytest.mark.parametrize("arch,kv_cache_dtype", [("qwen3", "auto"), ("llama", "auto"), ("qwen3", "fp8")])
def test_whole_model_rope_write_kv_equals_two_launches(tiny_model_dir, arch, kv_cache_dtype, monkeypatch):
    """A tiny model with the Triton attention and layer ops (interpreted): prompt logits with the
    one-launch rotary + K/V write equal those with the rotary and write_kv apart (an fp8 pool too,
    through the layers' scales), and the torch path's; the launches each way are the ones claimed."""
    from pagedserve.attention import backend, triton_ops

    def logits():
        return _prompt_logits(tiny_model_dir(arch), kv_cache_dtype=kv_cache_dtype)

    expected = logits()
    calls = {"rope_write_kv": 0, "write_kv": 0}
    for name in calls:
        real = getattr(triton_ops, name)
        monkeypatch.setattr(triton_ops, name, lambda *a, _real=real, _name=name, **kw: (
            calls.__setitem__(_name, calls[_name] + 1), _real(*a, **kw))[1])
    monkeypatch.setenv("PAGEDSERVE_FUSED", "force")
    monkeypatch.setitem(backend._BACKENDS, "cpu", triton_ops)
    fused.reset()
    try:
        one = logits()
        assert calls == {"rope_write_kv": 2, "write_kv": 0}  # one per layer of the two
        monkeypatch.setenv(backend.ROPE_STORE_ENV, "0")
        two = logits()
        assert calls == {"rope_write_kv": 2, "write_kv": 2}
    finally:
        fused.reset()
    torch.testing.assert_close(one, two, rtol=0, atol=0)
    torch.testing.assert_close(one, expected, rtol=1e-4, atol=1e-4 if kv_cache_dtype == "auto" else 1e-3)
