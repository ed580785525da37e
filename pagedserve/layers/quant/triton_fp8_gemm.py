"""The W8A8 GEMM in Triton, beside torch._scaled_mm (cuBLASLt); fp8_ops.fp8_gemm picks between them
(PAGEDSERVE_FP8_GEMM: cublas, triton, auto).

The arithmetic is fp8_ops.fp8_gemm's: C = (A @ B.T) * a_scale[m] * b_scale[n], fp8 operands,
float32 accumulation (the tensor cores' FP8 dot), the scales applied once to the accumulator, one
rounding to the output dtype. a_scale is per token [M, 1] (or one value, a static checkpoint
scale), b_scale per output channel [N] (or one value).

Split-K (SPLIT_K > 1) is for few tokens: a decode GEMM reads its whole weight once, and N / BLOCK_N
tiles alone (64 for N=4096) leave most of an H200's 132 SMs idle, so each tile's K loop is cut
into SPLIT_K programs. Each writes its float32 partial sum into a [SPLIT_K, M, N] buffer, and a
second kernel adds the SPLIT_K partials in a fixed order, applies the scales and rounds once: no
atomics, so the result is the same on every run, and nothing on the host depends on the data (the
pair is captured by CUDA graphs like any two kernels). Block sizes come from fp8_gemm_config.py.

M and the scale strides are not specialized on (do_not_specialize): a kernel variant is a config,
so the warm-up compiles every variant by running one token count per config bucket.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from pagedserve.layers.quant.fp8_gemm_config import get_config
from pagedserve.layers.triton_tile_order import grouped_tile
from pagedserve.host_math import cdiv

REDUCE_BLOCK = 512


@triton.jit(do_not_specialize=["M", "stride_as", "stride_bs"])
def fp8_gemm_kernel(a_ptr, b_ptr, c_ptr, p_ptr, a_scale_ptr, b_scale_ptr, M, N, K,
                    stride_am, stride_bn, stride_cm, stride_as, stride_bs,
                    IEEE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                    GROUP_M: tl.constexpr, SPLIT_K: tl.constexpr):
    """One (BLOCK_M, BLOCK_N) tile of C over split program_id(1)'s share of K. A [M, K] and B [N, K]
    are row-major e4m3 (B is the weight as stored: the tile loads it transposed). stride_as /
    stride_bs: 1 per row / channel, 0 for one scale. SPLIT_K 1: the scaled tile goes to C; else the
    raw float32 sum goes to the partials p [SPLIT_K, M, N]. IEEE: widen to float32 first (the
    interpreter has no fp8 dot)."""
    pid_m, pid_n = grouped_tile(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
    pid_k = tl.program_id(1)
    k_steps = tl.cdiv(K, BLOCK_K)
    per_split = tl.cdiv(k_steps, SPLIT_K)
    k_first = pid_k * per_split
    k_last = tl.minimum(k_first + per_split, k_steps)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_mask = offs_m < M
    n_mask = offs_n < N
    a_ptrs = a_ptr + offs_m.to(tl.int64)[:, None] * stride_am + (k_first * BLOCK_K + offs_k)[None, :]
    b_ptrs = b_ptr + offs_n.to(tl.int64)[None, :] * stride_bn + (k_first * BLOCK_K + offs_k)[:, None]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k in range(k_first, k_last):
        k_mask = offs_k < K - k * BLOCK_K
        a = tl.load(a_ptrs, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
        if IEEE:
            acc += tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
        else:
            acc += tl.dot(a, b)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    mn_mask = m_mask[:, None] & n_mask[None, :]
    if SPLIT_K == 1:
        a_s = tl.load(a_scale_ptr + offs_m * stride_as, mask=m_mask, other=0.0)
        b_s = tl.load(b_scale_ptr + offs_n * stride_bs, mask=n_mask, other=0.0)
        out = acc * a_s[:, None] * b_s[None, :]
        c_ptrs = c_ptr + offs_m.to(tl.int64)[:, None] * stride_cm + offs_n[None, :]
        tl.store(c_ptrs, out.to(c_ptr.dtype.element_ty), mask=mn_mask)
    else:
        p_ptrs = p_ptr + (pid_k.to(tl.int64) * M + offs_m.to(tl.int64)[:, None]) * N + offs_n[None, :]
        tl.store(p_ptrs, acc, mask=mn_mask)


@triton.jit(do_not_specialize=["M", "stride_as", "stride_bs"])
def splitk_reduce_kernel(p_ptr, c_ptr, a_scale_ptr, b_scale_ptr, M, N, stride_cm, stride_as, stride_bs,
                         SPLIT_K: tl.constexpr, BLOCK: tl.constexpr):
    """Row program_id(0), columns program_id(1) * BLOCK + [0, BLOCK) of C: the SPLIT_K partials
    summed in order 0, 1, ..., then scaled as the unsplit kernel scales its accumulator."""
    row = tl.program_id(0).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    n_mask = offs_n < N
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for s in tl.static_range(SPLIT_K):
        acc += tl.load(p_ptr + (s * M + row) * N + offs_n, mask=n_mask, other=0.0)
    a_s = tl.load(a_scale_ptr + row * stride_as)
    b_s = tl.load(b_scale_ptr + offs_n * stride_bs, mask=n_mask, other=0.0)
    out = acc * a_s * b_s
    tl.store(c_ptr + row * stride_cm + offs_n, out.to(c_ptr.dtype.element_ty), mask=n_mask)


def triton_fp8_gemm(xq: torch.Tensor, x_scale: torch.Tensor, wq: torch.Tensor, w_scale: torch.Tensor,
                    out_dtype: torch.dtype = torch.bfloat16, config: dict | None = None) -> torch.Tensor:
    """(xq * x_scale) @ (wq * w_scale[:, None]).T in out_dtype: xq [M, K], wq [N, K] e4m3 (rows
    contiguous); x_scale [M, 1] or one value, w_scale [N] or one value, float32. config: the
    fp8_gemm_config keys (the tuner's candidates); default: get_config's choice."""
    if xq.stride(-1) != 1:
        xq = xq.contiguous()
    (m, k), n = xq.shape, wq.shape[0]
    if wq.shape[1] != k or wq.stride(-1) != 1:
        raise ValueError(f"triton_fp8_gemm: weight {list(wq.shape)} (row stride {wq.stride(-1)}) for input {list(xq.shape)}")
    out = torch.empty(m, n, dtype=out_dtype, device=xq.device)
    if m == 0:
        return out
    x_scale, w_scale = x_scale.reshape(-1).float(), w_scale.reshape(-1).float()
    stride_as, stride_bs = (1 if x_scale.numel() > 1 else 0), (1 if w_scale.numel() > 1 else 0)
    cfg = dict(config or get_config(m, n, k, xq.device))
    split = cfg["SPLIT_K"]
    partials = out if split == 1 else torch.empty(split, m, n, dtype=torch.float32, device=xq.device)
    grid = (cdiv(m, cfg["BLOCK_M"]) * cdiv(n, cfg["BLOCK_N"]), split)
    interpret = os.environ.get("TRITON_INTERPRET") == "1"
    fp8_gemm_kernel[grid](xq, wq, out, partials, x_scale, w_scale, m, n, k, xq.stride(0), wq.stride(0), out.stride(0),
                          stride_as, stride_bs, IEEE=interpret, **cfg)
    if split > 1:
        splitk_reduce_kernel[(m, cdiv(n, REDUCE_BLOCK))](partials, out, x_scale, w_scale, m, n, out.stride(0),
                                                               stride_as, stride_bs, SPLIT_K=split, BLOCK=REDUCE_BLOCK)
    return out
