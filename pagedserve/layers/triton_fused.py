"""Triton kernels for the small per-token ops of a decoder layer: RMSNorm (with the residual add
fused in), SiLU-and-mul, and q/k rotary (with Qwen3's per-head q/k RMSNorm fused in).

Imported lazily, on CUDA only (pagedserve.layers.fused.fused_ops); the plain-torch code in
norm.py, activation.py and rotary.py is the CPU path and the oracle. Every kernel computes in
float32 and rounds to the activation dtype at exactly the points where the torch path (and HF)
rounds. Under the interpreter (round-to-nearest-even emulated) that makes them bit-equal to
torch in bfloat16; on the H200 they are within one bfloat16 ulp but not bit-equal (rotary
alone: >= 99% of elements identical; after Qwen3's q/k norm: 78-89%): the GPU's reductions,
rsqrt and exp differ from torch's in the last float32 bit, and the compiler may contract a
multiply and add whose intermediate rounding the torch path keeps.

The FP8 variants (rms_norm_fp8, fused_add_rms_norm_fp8, silu_and_mul_fp8) end the same
arithmetic with the dynamic per-token quantization of layers/quant/triton_fp8.py instead of a
store: y rounded to the activation dtype as above, scale = max(amax(y) / 448, MIN_SCALE),
q = e4m3(clamp(y / scale, +-448)), both divisions IEEE (div_rn), round to nearest even. The same
instructions as "the kernel above, then per_token_fp8_kernel", so bit-equal to that pair; against
the torch ops (norm, then fp8_ops.quantize_per_token_torch) they differ only where the norm does
(and in the scale's last bit on the H200, as triton_fp8's kernel does).

All wrappers allocate only by shape and never read values on the host: CUDA-graph capturable.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedserve.layers.quant.fp8_format import FP8_DTYPE, FP8_MAX, MIN_SCALE
from pagedserve.host_math import cdiv, next_power_of_2


@triton.jit
def _round(x, like_ptr):
    """Round float32 x to like_ptr's element type and back: one rounding, as torch's op in that dtype."""
    return x.to(like_ptr.dtype.element_ty).to(tl.float32)


@triton.jit
def _fp8_scale(y, FP8_MAX: tl.constexpr, MIN_SCALE: tl.constexpr):
    """A row's dynamic scale, as triton_fp8.per_token_fp8_kernel computes it (y: the whole row, or
    running maxima of |y|)."""
    return tl.maximum(tl.math.div_rn(tl.max(tl.abs(y), 0), FP8_MAX), MIN_SCALE)


@triton.jit
def _to_fp8(y, scale, q_ptr, FP8_MAX: tl.constexpr):
    # div_rn: IEEE division like torch's (Triton's "/" is approximate on the GPU).
    return tl.clamp(tl.math.div_rn(y, scale), -FP8_MAX, FP8_MAX).to(q_ptr.dtype.element_ty,
                                                                   fp_downcast_rounding="rtne")


@triton.jit
def _rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, q_ptr, scale_ptr,
                     x_stride, res_stride, out_stride, res_out_stride, q_stride, N, eps,
                     HAS_RESIDUAL: tl.constexpr, FP8_OUT: tl.constexpr, FP8_MAX: tl.constexpr,
                     MIN_SCALE: tl.constexpr, BLOCK: tl.constexpr):
    """FP8_OUT: write q (e4m3) and the row's scale instead of out; out_ptr then only names the
    activation dtype the normed values round to (it is not written)."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    x = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * res_stride + cols, mask=mask, other=0.0).to(tl.float32)
        x = _round(x + r, res_out_ptr)
        tl.store(res_out_ptr + row * res_out_stride + cols, x.to(res_out_ptr.dtype.element_ty), mask=mask)
    inv_rms = tl.rsqrt(tl.sum(x * x, axis=0) / N + eps)
    normed = _round(x * inv_rms, out_ptr)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    if FP8_OUT:
        y = _round(normed * w, out_ptr)  # the norm's output in the activation dtype; 0 past N
        scale = _fp8_scale(y, FP8_MAX, MIN_SCALE)
        tl.store(scale_ptr + row, scale)
        tl.store(q_ptr + row * q_stride + cols, _to_fp8(y, scale, q_ptr, FP8_MAX), mask=mask)
    else:
        tl.store(out_ptr + row * out_stride + cols, (normed * w).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _silu_mul(row_ptr, cols, mask, N):
    """silu(gate) * up at cols of one gate_up row ([gate | up], N each), rounded as torch rounds
    (silu, then the product) to the row's dtype, returned in float32; 0 where masked."""
    gate = tl.load(row_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(row_ptr + N + cols, mask=mask, other=0.0).to(tl.float32)
    act = _round(gate / (1.0 + tl.exp(-gate)), row_ptr)
    return _round(act * up, row_ptr)


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, x_stride, out_stride, N, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < N
    y = _silu_mul(x_ptr + row * x_stride, cols, mask, N)
    tl.store(out_ptr + row * out_stride + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _silu_and_mul_fp8_kernel(x_ptr, q_ptr, scale_ptr, x_stride, q_stride, N, FP8_MAX: tl.constexpr,
                             MIN_SCALE: tl.constexpr, BLOCK: tl.constexpr, ONE_PASS: tl.constexpr):
    """One program per row. ONE_PASS (the row fits one block): silu(gate) * up stays in registers
    between its amax and the quantized store. Otherwise two passes over the row (as
    per_token_fp8_kernel): the amax, then the same values recomputed and quantized (gate_up read
    twice, the second time mostly from L2, instead of a bf16 round trip through memory)."""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    x_row = x_ptr + row * x_stride
    if ONE_PASS:
        mask = offs < N
        y = _silu_mul(x_row, offs, mask, N)
        scale = _fp8_scale(y, FP8_MAX, MIN_SCALE)
        tl.store(scale_ptr + row, scale)
        tl.store(q_ptr + row * q_stride + offs, _to_fp8(y, scale, q_ptr, FP8_MAX), mask=mask)
    else:
        amax = tl.zeros([BLOCK], dtype=tl.float32)
        for start in range(0, N, BLOCK):
            amax = tl.maximum(amax, tl.abs(_silu_mul(x_row, start + offs, start + offs < N, N)))
        scale = _fp8_scale(amax, FP8_MAX, MIN_SCALE)
        tl.store(scale_ptr + row, scale)
        for start in range(0, N, BLOCK):
            cols = start + offs
            mask = cols < N
            y = _silu_mul(x_row, cols, mask, N)
            tl.store(q_ptr + row * q_stride + cols, _to_fp8(y, scale, q_ptr, FP8_MAX), mask=mask)


@triton.jit
def pool_value(y, src_ptr, dst_ptr, scale_ptr, heads, h_mask, DST_FP8: tl.constexpr, PER_HEAD: tl.constexpr):
    """K/V values y (float32, [heads, features]) as a pool stores them: rounded to the activations'
    dtype (what a separate write would have read), and for an fp8 pool divided by the scale (one,
    or one per head), saturated to +-448 and rounded to nearest even, as kv_quant.quantize_kv
    (div_rn: IEEE division, as torch divides)."""
    y = y.to(src_ptr.dtype.element_ty)
    if DST_FP8:
        if PER_HEAD:
            scale = tl.broadcast_to(tl.load(scale_ptr + heads, mask=h_mask, other=1.0)[:, None], y.shape)
        else:
            scale = tl.broadcast_to(tl.load(scale_ptr), y.shape)
        y = tl.clamp(tl.math.div_rn(y.to(tl.float32), scale), -448.0, 448.0)
        return y.to(dst_ptr.dtype.element_ty, fp_downcast_rounding="rtne")
    return y.to(dst_ptr.dtype.element_ty)


@triton.jit
def norm_rope_heads(ptr, heads, h_mask, stride_h, w_ptr, cos_ptr, sin_ptr, eps, HEAD_DIM: tl.constexpr,
                     HALF: tl.constexpr, REST: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_REST: tl.constexpr,
                     HAS_NORM: tl.constexpr, dst_ptr=None, dst_stride_h=0, dst_ok=False,
                     STORE_DST: tl.constexpr = False, dst_scale_ptr=None, DST_FP8: tl.constexpr = False,
                     DST_PER_HEAD: tl.constexpr = False):
    """Head vectors `heads` (h_mask: which are real) of one token in place: optional RMSNorm over
    HEAD_DIM = 2*HALF + REST, then NeoX rotary of the first 2*HALF features (the REST pass
    through). Rounds where the torch path rounds. STORE_DST: the whole result is also written to
    the head vectors at dst_ptr (stride dst_stride_h; only where dst_ok: a KV-pool slot,
    attention/triton_cache.rope_write_kv_kernel), quantized for an fp8 pool (pool_value)."""
    i = tl.arange(0, BLOCK_HALF)
    m = h_mask[:, None] & (i < HALF)[None, :]
    rows = ptr + heads[:, None] * stride_h
    if STORE_DST:
        dst_rows = dst_ptr + heads[:, None] * dst_stride_h
        dm = m & dst_ok
    x1 = tl.load(rows + i[None, :], mask=m, other=0.0).to(tl.float32)
    x2 = tl.load(rows + HALF + i[None, :], mask=m, other=0.0).to(tl.float32)
    if HAS_NORM:
        sum_sq = tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)
        if REST > 0:
            j = tl.arange(0, BLOCK_REST)
            mr = h_mask[:, None] & (j < REST)[None, :]
            xr = tl.load(rows + 2 * HALF + j[None, :], mask=mr, other=0.0).to(tl.float32)
            sum_sq += tl.sum(xr * xr, axis=1)
        inv_rms = tl.rsqrt(sum_sq / HEAD_DIM + eps)[:, None]
        w1 = tl.load(w_ptr + i, mask=i < HALF, other=0.0).to(tl.float32)[None, :]
        w2 = tl.load(w_ptr + HALF + i, mask=i < HALF, other=0.0).to(tl.float32)[None, :]
        x1 = _round(_round(x1 * inv_rms, ptr) * w1, ptr)
        x2 = _round(_round(x2 * inv_rms, ptr) * w2, ptr)
        if REST > 0:
            wr = tl.load(w_ptr + 2 * HALF + j, mask=j < REST, other=0.0).to(tl.float32)[None, :]
            yr = (_round(xr * inv_rms, ptr) * wr).to(ptr.dtype.element_ty)
            tl.store(rows + 2 * HALF + j[None, :], yr, mask=mr)
            if STORE_DST:
                tl.store(dst_rows + 2 * HALF + j[None, :], pool_value(yr.to(tl.float32), ptr, dst_ptr, dst_scale_ptr,
                                                                      heads, h_mask, DST_FP8, DST_PER_HEAD),
                         mask=mr & dst_ok)
    elif STORE_DST and REST > 0:  # the features past the rotary pass through: copied as they are
        j = tl.arange(0, BLOCK_REST)
        mr = h_mask[:, None] & (j < REST)[None, :]
        xr = tl.load(rows + 2 * HALF + j[None, :], mask=mr, other=0.0).to(tl.float32)
        tl.store(dst_rows + 2 * HALF + j[None, :],
                 pool_value(xr, ptr, dst_ptr, dst_scale_ptr, heads, h_mask, DST_FP8, DST_PER_HEAD), mask=mr & dst_ok)
    c1 = tl.load(cos_ptr + i, mask=i < HALF, other=0.0).to(tl.float32)[None, :]
    c2 = tl.load(cos_ptr + HALF + i, mask=i < HALF, other=0.0).to(tl.float32)[None, :]
    s1 = tl.load(sin_ptr + i, mask=i < HALF, other=0.0).to(tl.float32)[None, :]
    s2 = tl.load(sin_ptr + HALF + i, mask=i < HALF, other=0.0).to(tl.float32)[None, :]
    # torch: rot * cos + cat(-x2, x1) * sin, each op rounded to the dtype
    o1 = _round(x1 * c1, ptr) - _round(x2 * s1, ptr)
    o2 = _round(x2 * c2, ptr) + _round(x1 * s2, ptr)
    tl.store(rows + i[None, :], o1.to(ptr.dtype.element_ty), mask=m)
    tl.store(rows + HALF + i[None, :], o2.to(ptr.dtype.element_ty), mask=m)
    if STORE_DST:
        tl.store(dst_rows + i[None, :], pool_value(o1, ptr, dst_ptr, dst_scale_ptr, heads, h_mask, DST_FP8,
                                                   DST_PER_HEAD), mask=dm)
        tl.store(dst_rows + HALF + i[None, :], pool_value(o2, ptr, dst_ptr, dst_scale_ptr, heads, h_mask, DST_FP8,
                                                          DST_PER_HEAD), mask=dm)


# A one-token step may give cos/sin a size-1 leading dim with any stride: do not compile per value.
@triton.jit(do_not_specialize=["cos_stride", "sin_stride"])
def _qk_norm_rope_kernel(q_ptr, k_ptr, qw_ptr, kw_ptr, cos_ptr, sin_ptr,
                         q_stride_t, q_stride_h, k_stride_t, k_stride_h, cos_stride, sin_stride,
                         NUM_Q_HEADS, NUM_K_HEADS, eps, HEAD_DIM: tl.constexpr, HALF: tl.constexpr,
                         REST: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_REST: tl.constexpr,
                         HAS_NORM: tl.constexpr, HEADS: tl.constexpr):
    """Grid (tokens, q head blocks + k head blocks): one program per HEADS head vectors of q or k
    of one token (one program per head vector, as until the 37th session, made 327k one-warp
    programs of a Llama-3.1-8B 8,192-token chunk: 0.19 ms, ~4x its memory time on the H200)."""
    t = tl.program_id(0).to(tl.int64)
    block = tl.program_id(1)
    q_blocks = (NUM_Q_HEADS + HEADS - 1) // HEADS
    cos = cos_ptr + t * cos_stride
    sin = sin_ptr + t * sin_stride
    h = tl.arange(0, HEADS)
    if block < q_blocks:
        heads = block * HEADS + h
        norm_rope_heads(q_ptr + t * q_stride_t, heads, heads < NUM_Q_HEADS, q_stride_h, qw_ptr, cos, sin, eps,
                         HEAD_DIM, HALF, REST, BLOCK_HALF, BLOCK_REST, HAS_NORM)
    else:
        heads = (block - q_blocks) * HEADS + h
        norm_rope_heads(k_ptr + t * k_stride_t, heads, heads < NUM_K_HEADS, k_stride_h, kw_ptr, cos, sin, eps,
                         HEAD_DIM, HALF, REST, BLOCK_HALF, BLOCK_REST, HAS_NORM)


def _rows(x: torch.Tensor) -> torch.Tensor:
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def _norm_warps(block: int) -> int:
    return min(max(block // 512, 1), 8)


def _launch_norm(rows, res, weight, out, res_out, q, scale, eps, has_residual: bool, fp8_out: bool) -> None:
    n = rows.shape[1]
    block = next_power_of_2(n)
    if rows.shape[0]:
        _rms_norm_kernel[(rows.shape[0],)](
            rows, res, weight, out, res_out, q, scale, rows.stride(0), res.stride(0) if has_residual else 0,
            out.stride(0), res_out.stride(0) if has_residual else 0, q.stride(0) if fp8_out else 0, n, eps,
            HAS_RESIDUAL=has_residual, FP8_OUT=fp8_out, FP8_MAX=FP8_MAX, MIN_SCALE=MIN_SCALE, BLOCK=block,
            num_warps=_norm_warps(block))


def _fp8_rows(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return (torch.empty(rows.shape, dtype=FP8_DTYPE, device=rows.device),
            torch.empty(rows.shape[0], 1, dtype=torch.float32, device=rows.device))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * RMSNorm(x) over the last dim: normalised in float32, rounded to x.dtype, then weighted."""
    rows = _rows(x)
    out = torch.empty(rows.shape, dtype=x.dtype, device=x.device)
    _launch_norm(rows, rows, weight, out, out, out, out, eps, has_residual=False, fp8_out=False)
    return out.view(x.shape)


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                       eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(weight * RMSNorm(s), s) with s = x + residual rounded once to x.dtype, as torch's add does."""
    rows, res = _rows(x), _rows(residual)
    out = torch.empty(rows.shape, dtype=x.dtype, device=x.device)
    res_out = torch.empty_like(out)
    _launch_norm(rows, res, weight, out, res_out, out, out, eps, has_residual=True, fp8_out=False)
    return out.view(x.shape), res_out.view(x.shape)


def rms_norm_fp8(x: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """rms_norm(x) quantized per token: (fp8 shaped as x, float32 scale [rows, 1])."""
    rows = _rows(x)
    q, scale = _fp8_rows(rows)
    _launch_norm(rows, rows, weight, rows, rows, q, scale, eps, has_residual=False, fp8_out=True)
    return q.view(x.shape), scale


def fused_add_rms_norm_fp8(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                           eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """fused_add_rms_norm with the normed output quantized per token: (fp8, scale [rows, 1], s)."""
    rows, res = _rows(x), _rows(residual)
    q, scale = _fp8_rows(rows)
    res_out = torch.empty(rows.shape, dtype=x.dtype, device=x.device)
    _launch_norm(rows, res, weight, rows, res_out, q, scale, eps, has_residual=True, fp8_out=True)
    return q.view(x.shape), scale, res_out.view(x.shape)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for gate_up = [..., 2 * I] (gate first): silu rounded to the dtype, then the product."""
    rows = _rows(gate_up)
    n = rows.shape[1] // 2
    out = torch.empty((rows.shape[0], n), dtype=gate_up.dtype, device=gate_up.device)
    block = min(next_power_of_2(n), 1024)
    if rows.shape[0]:
        _silu_and_mul_kernel[(rows.shape[0], cdiv(n, block))](rows, out, rows.stride(0), out.stride(0), n,
                                                                     BLOCK=block, num_warps=4)
    return out.view(*gate_up.shape[:-1], n)


_SILU_FP8_ONE_PASS_MAX = 16384


def silu_and_mul_fp8(gate_up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """silu_and_mul(gate_up) quantized per token: (fp8 [..., I], float32 scale [rows, 1])."""
    rows = _rows(gate_up)
    n = rows.shape[1] // 2
    q = torch.empty((rows.shape[0], n), dtype=FP8_DTYPE, device=gate_up.device)
    scale = torch.empty(rows.shape[0], 1, dtype=torch.float32, device=gate_up.device)
    # Up to 16k features (Llama-3.1-8B's 14336) a row is one block of 16 warps, read once; a
    # longer row is walked twice in blocks of 4096.
    block = next_power_of_2(n)
    one_pass = block <= _SILU_FP8_ONE_PASS_MAX
    block = block if one_pass else 4096
    if rows.shape[0]:
        _silu_and_mul_fp8_kernel[(rows.shape[0],)](rows, q, scale, rows.stride(0), q.stride(0), n, FP8_MAX=FP8_MAX,
                                                   MIN_SCALE=MIN_SCALE, BLOCK=block, ONE_PASS=one_pass,
                                                   num_warps=min(max(block // 1024, 4), 16))
    return q.view(*gate_up.shape[:-1], n), scale


QK_ROPE_HEADS = 8  # head vectors a program of qk_norm_rotary_ takes (at most)


def qk_norm_rotary_(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                    q_weight: torch.Tensor | None = None, k_weight: torch.Tensor | None = None,
                    eps: float = 1e-6) -> tuple[torch.Tensor, torch.Tensor]:
    """In place on q [T, Hq, D] and k [T, Hk, D] (strided views of one step's fresh qkv are fine):
    optional per-head RMSNorm (q_weight, k_weight: [D]), then rotary with cos/sin [T, 1, rotary_dim]
    (rotary_dim <= D, even; features past it pass through). Returns (q, k)."""
    T, num_q, D = q.shape
    rd = cos.shape[-1]
    if q.stride(-1) != 1 or k.stride(-1) != 1 or rd % 2 or rd > D or k.shape[-1] != D:
        raise ValueError(f"qk_norm_rotary_: needs unit-stride head dims and an even rotary_dim <= head_dim, "
                         f"got q {tuple(q.shape)}/{q.stride()}, k {tuple(k.shape)}/{k.stride()}, rotary_dim {rd}")
    has_norm = q_weight is not None
    cos2, sin2 = cos.reshape(T, rd), sin.reshape(T, rd)
    num_k = k.shape[1]
    heads = min(QK_ROPE_HEADS, next_power_of_2(max(num_q, num_k)))
    if T:
        _qk_norm_rope_kernel[(T, cdiv(num_q, heads) + cdiv(num_k, heads))](
            q, k, q_weight if has_norm else q, k_weight if has_norm else k, cos2, sin2,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos2.stride(0), sin2.stride(0),
            num_q, num_k, eps, HEAD_DIM=D, HALF=rd // 2, REST=D - rd, BLOCK_HALF=next_power_of_2(max(rd // 2, 1)),
            BLOCK_REST=next_power_of_2(max(D - rd, 1)), HAS_NORM=has_norm, HEADS=heads, num_warps=4)
    return q, k
