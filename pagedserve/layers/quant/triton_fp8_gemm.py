"""The W8A8 GEMM in Triton, beside torch._scaled_mm (cuBLASLt), for an A/B on the GPU.

fp8_ops.fp8_gemm runs cuBLASLt's FP8 path by default. Issue 34 asks for Triton "where it wins",
measured: this kernel is the candidate, chosen with PAGEDSERVE_FP8_GEMM=triton (every FP8 linear
then uses it) and timed against cuBLASLt by benchmarks/kernels/fp8_gemm_ab.py at Llama-3.1-8B's
shapes. It stays opt-in until that measurement says where it wins.

The arithmetic is fp8_ops.fp8_gemm's: C = (A @ B.T) * a_scale[m] * b_scale[n], fp8 operands,
float32 accumulation (the tensor cores' FP8 dot), the scales applied once to the accumulator, one
rounding to the output dtype. a_scale is per token [M, 1] (or one value, a static checkpoint
scale), b_scale per output channel [N] (or one value).
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from pagedserve.layers.triton_tile_order import grouped_tile

@triton.jit
def fp8_gemm_kernel(a_ptr, b_ptr, c_ptr, a_scale_ptr, b_scale_ptr, M, N, K,
                    stride_am, stride_bn, stride_cm, stride_as, stride_bs,
                    IEEE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                    GROUP_M: tl.constexpr):
    """One (BLOCK_M, BLOCK_N) tile of C. A [M, K] and B [N, K] are row-major e4m3 (B is the weight
    as stored: the tile loads it transposed). stride_as / stride_bs: 1 per row / channel, 0 for one
    scale. IEEE: widen to float32 first (the interpreter has no fp8 dot)."""
    pid_m, pid_n = grouped_tile(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_mask = offs_m < M
    n_mask = offs_n < N
    a_ptrs = a_ptr + offs_m.to(tl.int64)[:, None] * stride_am + offs_k[None, :]
    b_ptrs = b_ptr + offs_n.to(tl.int64)[None, :] * stride_bn + offs_k[:, None]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        k_mask = offs_k < K - k * BLOCK_K
        a = tl.load(a_ptrs, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
        if IEEE:
            acc += tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
        else:
            acc += tl.dot(a, b)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    a_s = tl.load(a_scale_ptr + offs_m * stride_as, mask=m_mask, other=0.0)
    b_s = tl.load(b_scale_ptr + offs_n * stride_bs, mask=n_mask, other=0.0)
    out = acc * a_s[:, None] * b_s[None, :]
    c_ptrs = c_ptr + offs_m.to(tl.int64)[:, None] * stride_cm + offs_n[None, :]
    tl.store(c_ptrs, out.to(c_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


def gemm_config(m: int) -> dict:
    """Block sizes by token count (untuned starting points: narrow row blocks for decode, square
    tiles for prefill). BLOCK_K 128: an fp8 dot takes K in steps of 32, and wider steps halve the
    loop's overhead per byte."""
    if m <= 16:
        return dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, GROUP_M=1, num_warps=4, num_stages=4)
    if m <= 64:
        return dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=128, GROUP_M=1, num_warps=4, num_stages=4)
    if m <= 256:
        return dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=128, GROUP_M=8, num_warps=4, num_stages=3)
    return dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=128, GROUP_M=8, num_warps=8, num_stages=3)


def triton_fp8_gemm(xq: torch.Tensor, x_scale: torch.Tensor, wq: torch.Tensor, w_scale: torch.Tensor,
                    out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """(xq * x_scale) @ (wq * w_scale[:, None]).T in out_dtype: xq [M, K], wq [N, K] e4m3 (rows
    contiguous); x_scale [M, 1] or one value, w_scale [N] or one value, float32."""
    if xq.stride(-1) != 1:
        xq = xq.contiguous()
    (m, k), n = xq.shape, wq.shape[0]
    if wq.shape[1] != k or wq.stride(-1) != 1:
        raise ValueError(f"triton_fp8_gemm: weight {list(wq.shape)} (row stride {wq.stride(-1)}) for input {list(xq.shape)}")
    out = torch.empty(m, n, dtype=out_dtype, device=xq.device)
    if m == 0:
        return out
    x_scale, w_scale = x_scale.reshape(-1).float(), w_scale.reshape(-1).float()
    cfg = gemm_config(m)
    grid = (triton.cdiv(m, cfg["BLOCK_M"]) * triton.cdiv(n, cfg["BLOCK_N"]),)
    fp8_gemm_kernel[grid](xq, wq, out, x_scale, w_scale, m, n, k, xq.stride(0), wq.stride(0), out.stride(0),
                          1 if x_scale.numel() > 1 else 0, 1 if w_scale.numel() > 1 else 0,
                          IEEE=os.environ.get("TRITON_INTERPRET") == "1", **cfg)
    return out
