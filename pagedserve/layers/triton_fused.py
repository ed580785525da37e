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

All wrappers allocate only by shape and never read values on the host: CUDA-graph capturable.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _round(x, like_ptr):
    """Round float32 x to like_ptr's element type and back: one rounding, as torch's op in that dtype."""
    return x.to(like_ptr.dtype.element_ty).to(tl.float32)


@triton.jit
def _rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr,
                     x_stride, res_stride, out_stride, res_out_stride, N, eps,
                     HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
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
    tl.store(out_ptr + row * out_stride + cols, (normed * w).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, x_stride, out_stride, N, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < N
    gate = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * x_stride + N + cols, mask=mask, other=0.0).to(tl.float32)
    act = _round(gate / (1.0 + tl.exp(-gate)), out_ptr)
    tl.store(out_ptr + row * out_stride + cols, (act * up).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _norm_rope_head(ptr, w_ptr, cos_ptr, sin_ptr, eps, HEAD_DIM: tl.constexpr, HALF: tl.constexpr,
                    REST: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_REST: tl.constexpr,
                    HAS_NORM: tl.constexpr):
    """One head vector in place: optional RMSNorm over HEAD_DIM = 2*HALF + REST, then NeoX rotary
    of the first 2*HALF features (the REST pass through). Rounds where the torch path rounds."""
    i = tl.arange(0, BLOCK_HALF)
    m = i < HALF
    x1 = tl.load(ptr + i, mask=m, other=0.0).to(tl.float32)
    x2 = tl.load(ptr + HALF + i, mask=m, other=0.0).to(tl.float32)
    if HAS_NORM:
        sum_sq = tl.sum(x1 * x1, axis=0) + tl.sum(x2 * x2, axis=0)
        if REST > 0:
            j = tl.arange(0, BLOCK_REST)
            mr = j < REST
            xr = tl.load(ptr + 2 * HALF + j, mask=mr, other=0.0).to(tl.float32)
            sum_sq += tl.sum(xr * xr, axis=0)
        inv_rms = tl.rsqrt(sum_sq / HEAD_DIM + eps)
        x1 = _round(_round(x1 * inv_rms, ptr) * tl.load(w_ptr + i, mask=m, other=0.0).to(tl.float32), ptr)
        x2 = _round(_round(x2 * inv_rms, ptr) * tl.load(w_ptr + HALF + i, mask=m, other=0.0).to(tl.float32),
                    ptr)
        if REST > 0:
            wr = tl.load(w_ptr + 2 * HALF + j, mask=mr, other=0.0).to(tl.float32)
            tl.store(ptr + 2 * HALF + j, (_round(xr * inv_rms, ptr) * wr).to(ptr.dtype.element_ty), mask=mr)
    c1 = tl.load(cos_ptr + i, mask=m, other=0.0).to(tl.float32)
    c2 = tl.load(cos_ptr + HALF + i, mask=m, other=0.0).to(tl.float32)
    s1 = tl.load(sin_ptr + i, mask=m, other=0.0).to(tl.float32)
    s2 = tl.load(sin_ptr + HALF + i, mask=m, other=0.0).to(tl.float32)
    # torch: rot * cos + cat(-x2, x1) * sin, each op rounded to the dtype
    o1 = _round(x1 * c1, ptr) - _round(x2 * s1, ptr)
    o2 = _round(x2 * c2, ptr) + _round(x1 * s2, ptr)
    tl.store(ptr + i, o1.to(ptr.dtype.element_ty), mask=m)
    tl.store(ptr + HALF + i, o2.to(ptr.dtype.element_ty), mask=m)


# A one-token step may give cos/sin a size-1 leading dim with any stride: do not compile per value.
@triton.jit(do_not_specialize=["cos_stride", "sin_stride"])
def _qk_norm_rope_kernel(q_ptr, k_ptr, qw_ptr, kw_ptr, cos_ptr, sin_ptr,
                         q_stride_t, q_stride_h, k_stride_t, k_stride_h, cos_stride, sin_stride,
                         NUM_Q_HEADS, eps, HEAD_DIM: tl.constexpr, HALF: tl.constexpr, REST: tl.constexpr,
                         BLOCK_HALF: tl.constexpr, BLOCK_REST: tl.constexpr, HAS_NORM: tl.constexpr):
    """Grid (tokens, q heads + k heads): one program per head vector of q or k."""
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    cos = cos_ptr + t * cos_stride
    sin = sin_ptr + t * sin_stride
    if h < NUM_Q_HEADS:
        _norm_rope_head(q_ptr + t * q_stride_t + h * q_stride_h, qw_ptr, cos, sin, eps,
                        HEAD_DIM, HALF, REST, BLOCK_HALF, BLOCK_REST, HAS_NORM)
    else:
        _norm_rope_head(k_ptr + t * k_stride_t + (h - NUM_Q_HEADS) * k_stride_h, kw_ptr, cos, sin, eps,
                        HEAD_DIM, HALF, REST, BLOCK_HALF, BLOCK_REST, HAS_NORM)


def _rows(x: torch.Tensor) -> torch.Tensor:
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def _norm_warps(block: int) -> int:
    return min(max(block // 512, 1), 8)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * RMSNorm(x) over the last dim: normalised in float32, rounded to x.dtype, then weighted."""
    rows = _rows(x)
    out = torch.empty(rows.shape, dtype=x.dtype, device=x.device)
    n = rows.shape[1]
    block = triton.next_power_of_2(n)
    if rows.shape[0]:
        _rms_norm_kernel[(rows.shape[0],)](rows, rows, weight, out, out, rows.stride(0), 0, out.stride(0), 0,
                                           n, eps, HAS_RESIDUAL=False, BLOCK=block, num_warps=_norm_warps(block))
    return out.view(x.shape)


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                       eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(weight * RMSNorm(s), s) with s = x + residual rounded once to x.dtype, as torch's add does."""
    rows, res = _rows(x), _rows(residual)
    out = torch.empty(rows.shape, dtype=x.dtype, device=x.device)
    res_out = torch.empty_like(out)
    n = rows.shape[1]
    block = triton.next_power_of_2(n)
    if rows.shape[0]:
        _rms_norm_kernel[(rows.shape[0],)](rows, res, weight, out, res_out, rows.stride(0), res.stride(0),
                                           out.stride(0), res_out.stride(0), n, eps, HAS_RESIDUAL=True,
                                           BLOCK=block, num_warps=_norm_warps(block))
    return out.view(x.shape), res_out.view(x.shape)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for gate_up = [..., 2 * I] (gate first): silu rounded to the dtype, then the product."""
    rows = _rows(gate_up)
    n = rows.shape[1] // 2
    out = torch.empty((rows.shape[0], n), dtype=gate_up.dtype, device=gate_up.device)
    block = min(triton.next_power_of_2(n), 1024)
    if rows.shape[0]:
        _silu_and_mul_kernel[(rows.shape[0], triton.cdiv(n, block))](rows, out, rows.stride(0), out.stride(0), n,
                                                                     BLOCK=block, num_warps=4)
    return out.view(*gate_up.shape[:-1], n)


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
    if T:
        _qk_norm_rope_kernel[(T, num_q + k.shape[1])](
            q, k, q_weight if has_norm else q, k_weight if has_norm else k, cos2, sin2,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos2.stride(0), sin2.stride(0),
            num_q, eps, HEAD_DIM=D, HALF=rd // 2, REST=D - rd, BLOCK_HALF=triton.next_power_of_2(max(rd // 2, 1)),
            BLOCK_REST=triton.next_power_of_2(max(D - rd, 1)), HAS_NORM=has_norm, num_warps=1)
    return q, k
