"""Triton kernels of the MoE layer: routing, and the grouped GEMM over expert-sorted rows.

Imported lazily (pagedserve.layers.fused.fused_moe_ops): on CUDA by default, on CPU only under
TRITON_INTERPRET=1 (the tests). reference.py is the oracle.

route: one program per token does softmax (float32), top-k and the optional renormalisation.

fused_experts: rows are (token, slot) pairs laid out expert by expert, padded to BLOCK_M (by one
program of triton_align.py up to its MAX_PAIRS pairs, by align.py's torch ops beyond). Two
launches of one kernel:
  1. gate/up: each program multiplies BLOCK_M rows of x (pair // top_k) by BLOCK_N columns of
     its expert's gate rows and the same columns of its up rows (two accumulators), then writes
     silu(gate) * up for those columns: the [T * top_k, I] activation never exists unfused.
  2. down: rows of that activation times the expert's down matrix, times the pair's routing
     weight, written per pair; the top_k rows of a token are then summed (one torch sum).
Rounding follows HF's (and reference.py's): gate and up rounded to the activation dtype, silu
rounded, the product rounded; down rounded, then times the weight and rounded. Every size is
a function of the shapes, nothing is read on the host: capturable in a CUDA graph. The two
workspaces (T*top_k*I and T*top_k*H elements) are allocated per call, so the start-up memory
profile (runner/kv_sizing.py), which runs a forward of the largest step, counts them.

FP8 experts (W8A8, w13/w2 float8_e4m3fn with float32 scales per expert and output row): the
tokens are quantized per token (fp8_ops.quantize_per_token: one Triton kernel; or a checkpoint's
static scale) before the gate/up launch, and silu(gate) * up per (token, slot) row before the down
launch; each tl.dot takes fp8 operands (the tensor cores' FP8 path) into a float32 accumulator, and
the epilogue multiplies it by the row's activation scale and the column's weight scale before the
same roundings. The router and the outputs stay in the activation dtype; the fp8 copies of the
two GEMMs' inputs (T*H and T*top_k*I bytes) are workspaces like the others.
"""
from __future__ import annotations

import logging
import os

import torch
import triton
import triton.language as tl

from pagedserve.layers.fused_moe import triton_align
from pagedserve.layers.fused_moe.align import align_block_size
from pagedserve.layers.fused_moe.config import get_config
from pagedserve.layers.triton_tile_order import grouped_tile
from pagedserve.layers.fused_moe.reference import quantize_activations
from pagedserve.layers.quant.fp8_format import FP8_DTYPE
from pagedserve.host_math import cdiv, next_power_of_2

logger = logging.getLogger(__name__)


@triton.jit
def _route_kernel(logits_ptr, weights_ptr, ids_ptr, E, stride, TOP_K: tl.constexpr, BLOCK_E: tl.constexpr,
                  BLOCK_TOPK: tl.constexpr, RENORMALIZE: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_E)
    mask = offs < E
    x = tl.load(logits_ptr + row * stride + offs, mask=mask, other=float("-inf")).to(tl.float32)
    x = tl.exp(x - tl.max(x, axis=0))
    p = tl.where(mask, x / tl.sum(x, axis=0), -1.0)
    slots = tl.arange(0, BLOCK_TOPK)
    vals = tl.zeros([BLOCK_TOPK], dtype=tl.float32)
    idxs = tl.zeros([BLOCK_TOPK], dtype=tl.int32)
    for k in tl.static_range(TOP_K):
        best = tl.max(p, axis=0)
        idx = tl.min(tl.where(p == best, offs, BLOCK_E), axis=0)  # the lowest id among equals
        vals = tl.where(slots == k, best, vals)
        idxs = tl.where(slots == k, idx, idxs)
        p = tl.where(offs == idx, -1.0, p)
    if RENORMALIZE:
        vals = vals / tl.sum(vals, axis=0)
    out_mask = slots < TOP_K
    tl.store(weights_ptr + row * TOP_K + slots, vals, mask=out_mask)
    tl.store(ids_ptr + row * TOP_K + slots, idxs, mask=out_mask)


def route(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    T, E = router_logits.shape
    logits = router_logits if router_logits.stride(-1) == 1 else router_logits.contiguous()
    weights = torch.empty(T, top_k, dtype=torch.float32, device=logits.device)
    ids = torch.empty(T, top_k, dtype=torch.int32, device=logits.device)
    if T:
        _route_kernel[(T,)](logits, weights, ids, E, logits.stride(0), TOP_K=top_k,
                            BLOCK_E=max(2, next_power_of_2(E)), BLOCK_TOPK=max(2, next_power_of_2(top_k)),
                            RENORMALIZE=renormalize)
    return weights, ids


@triton.jit
def _round(x, like_ptr):
    """Round float32 x to like_ptr's element type and back: one rounding, as torch's op in that dtype."""
    return x.to(like_ptr.dtype.element_ty).to(tl.float32)


# EM and num_pairs change with the token count: unspecialised, so a count the warm-up skipped
# (say an odd one) does not compile a new variant mid-serving. N and K are the model's.
@triton.jit(do_not_specialize=["EM", "num_pairs"])
def _moe_gemm_kernel(a_ptr, b_ptr, c_ptr, weights_ptr, sorted_ids_ptr, block_expert_ptr, num_padded_ptr,
                     a_scale_ptr, b_scale_ptr, N, K, EM, num_pairs,
                     stride_am, stride_ak, stride_be, stride_bn, stride_bk, stride_cm, stride_cn, stride_bse,
                     A_ROW_DIV: tl.constexpr, GATED: tl.constexpr, MUL_WEIGHT: tl.constexpr,
                     IEEE: tl.constexpr, FP8: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    """C[pair, n] = f(A[pair // A_ROW_DIV, :] @ B[expert, n, :]) for the rows of one BLOCK_M block.
    GATED: B holds 2N rows (gate, then up) and f is silu(gate) * up. MUL_WEIGHT: times weights[pair].
    FP8: A and B are e4m3; the product is scaled by a_scale[A row] * b_scale[expert, n] (float32)."""
    pid_m, pid_n = grouped_tile(tl.program_id(0), EM, N, BLOCK_M, BLOCK_N, GROUP_M)
    if pid_m * BLOCK_M >= tl.load(num_padded_ptr):
        return
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    if expert < 0:
        return
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(sorted_ids_ptr + offs_m, mask=offs_m < EM, other=num_pairs).to(tl.int64)
    row_mask = pair < num_pairs
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + (pair // A_ROW_DIV)[:, None] * stride_am + offs_k[None, :] * stride_ak
    b_ptrs = b_ptr + expert * stride_be + offs_n[None, :] * stride_bn + offs_k[:, None] * stride_bk
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        k_mask = offs_k < K - k * BLOCK_K
        a = tl.load(a_ptrs, mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
        if IEEE:  # float32 operands, or the interpreter (see _dot_in_float32)
            a = a.to(tl.float32)
            acc += tl.dot(a, b.to(tl.float32), input_precision="ieee")
        else:
            acc += tl.dot(a, b)
        if GATED:
            b_up = tl.load(b_ptrs + N * stride_bn, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
            if IEEE:
                acc_up += tl.dot(a, b_up.to(tl.float32), input_precision="ieee")
            else:
                acc_up += tl.dot(a, b_up)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk
    if FP8:  # dequantize the accumulator: one multiply per element, outside the K loop
        a_s = tl.load(a_scale_ptr + pair // A_ROW_DIV, mask=row_mask, other=0.0)
        b_s = tl.load(b_scale_ptr + expert * stride_bse + offs_n, mask=n_mask, other=0.0)
        acc = acc * a_s[:, None] * b_s[None, :]
        if GATED:
            b_s_up = tl.load(b_scale_ptr + expert * stride_bse + N + offs_n, mask=n_mask, other=0.0)
            acc_up = acc_up * a_s[:, None] * b_s_up[None, :]
    if GATED:
        gate = _round(acc, c_ptr)
        act = _round(gate / (1.0 + tl.exp(-gate)), c_ptr)
        out = act * _round(acc_up, c_ptr)
    else:
        out = _round(acc, c_ptr)
    if MUL_WEIGHT:
        w = tl.load(weights_ptr + pair, mask=row_mask, other=0.0).to(tl.float32)
        out = out * w[:, None]
    c_ptrs = c_ptr + pair[:, None] * stride_cm + offs_n[None, :] * stride_cn
    tl.store(c_ptrs, out.to(c_ptr.dtype.element_ty), mask=row_mask[:, None] & n_mask[None, :])


def _dot_in_float32(dtype: torch.dtype) -> bool:
    """float32 operands take an IEEE float32 dot (not TF32: the torch path is exact float32).
    Under Triton 3.6's interpreter a bfloat16 tl.dot returns garbage (it multiplies the raw
    16-bit storage), so there the operands are widened first: the same result, since a product of
    two bfloat16 values is exact in float32 and the GPU's dot accumulates in float32 too."""
    return dtype == torch.float32 or os.environ.get("TRITON_INTERPRET") == "1"


def _gemm(a, b, c, weights, sorted_ids, block_expert, num_padded, n, k, num_pairs, a_row_div, gated, cfg,
          a_scale=None, b_scale=None):
    """a_scale [rows of a, 1] and b_scale [E, rows of b] float32 for fp8 a and b; None otherwise."""
    em = sorted_ids.numel()
    fp8 = b_scale is not None
    grid = (cdiv(em, cfg["BLOCK_M"]) * cdiv(n, cfg["BLOCK_N"]),)
    _moe_gemm_kernel[grid](
        a, b, c, weights, sorted_ids, block_expert, num_padded,
        a_scale if fp8 else weights, b_scale if fp8 else weights, n, k, em, num_pairs,
        a.stride(0), a.stride(1), b.stride(0), b.stride(1), b.stride(2), c.stride(0), c.stride(1),
        b_scale.stride(0) if fp8 else 0,
        A_ROW_DIV=a_row_div, GATED=gated, MUL_WEIGHT=not gated,
        IEEE=_dot_in_float32(a.dtype), FP8=fp8,
        BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], BLOCK_K=cfg["BLOCK_K"], GROUP_M=cfg["GROUP_M"],
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])


_ONE_PROGRAM_ALIGN = {"ok": True}


def _align(topk_ids: torch.Tensor, num_experts: int, block_m: int):
    """triton_align's one program where it applies, else align.py's torch ops. Should the one
    program fail to compile on this GPU (it first runs eagerly: in the warm-up, or the eager pass
    before each graph capture), the torch ops take over for good, with a warning."""
    if topk_ids.numel() <= triton_align.MAX_PAIRS and _ONE_PROGRAM_ALIGN["ok"]:
        try:
            return triton_align.align_block_size(topk_ids, num_experts, block_m)
        except Exception as e:  # noqa: BLE001  (a compiler error: keep serving, slower)
            if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
                raise
            _ONE_PROGRAM_ALIGN["ok"] = False
            logger.warning("one-program MoE align failed (%s: %s); using the torch sort/pad", type(e).__name__, e)
    return align_block_size(topk_ids, num_experts, block_m)


def fused_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                  topk_ids: torch.Tensor, config: dict | None = None, may_drop: bool = False,
                  w13_scale: torch.Tensor | None = None, w2_scale: torch.Tensor | None = None,
                  a13_scale: torch.Tensor | None = None, a2_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Same contract as reference.fused_experts_torch; `config` overrides the tuned block sizes.
    may_drop: some ids may be E (dropped pairs, whose rows no program writes: zeroed first)."""
    T, H = x.shape
    E, two_i, _ = w13.shape
    inter, top_k = two_i // 2, topk_ids.shape[1]
    if T == 0:
        return torch.zeros_like(x)
    fp8 = w13.dtype == FP8_DTYPE
    if fp8 and (w13_scale is None or w2_scale is None):
        raise ValueError("FP8 experts need w13_scale and w2_scale")
    cfg = config or get_config(T, E, H, inter, top_k, w13.dtype, x.device)
    if fp8 and cfg["BLOCK_K"] < 32:  # an 8-bit tensor-core dot takes K in steps of 32
        cfg = dict(cfg, BLOCK_K=32)
    x = x if x.stride(-1) == 1 else x.contiguous()
    weights = topk_weights.contiguous()
    pairs = T * top_k
    sorted_ids, block_expert, num_padded = _align(topk_ids, E, cfg["BLOCK_M"])
    a, a_scale = quantize_activations(x, a13_scale) if fp8 else (x, None)
    act = torch.empty(pairs, inter, dtype=x.dtype, device=x.device)
    _gemm(a, w13, act, weights, sorted_ids, block_expert, num_padded, inter, H, pairs, top_k, True, cfg,
          a_scale, w13_scale if fp8 else None)
    a, a_scale = quantize_activations(act, a2_scale) if fp8 else (act, None)
    down = (torch.zeros if may_drop else torch.empty)(pairs, H, dtype=x.dtype, device=x.device)
    _gemm(a, w2, down, weights, sorted_ids, block_expert, num_padded, H, inter, pairs, 1, False, cfg,
          a_scale, w2_scale if fp8 else None)
    return down.view(T, top_k, H).sum(dim=1)
