"""The plain torch MoE: the CPU path and the oracle for the Triton kernels.

A loop over the experts that received a pair, in expert order, as HF transformers computes it:
gate and up projections each rounded to the activation dtype, silu(gate) * up, the down
projection, times the routing weight, index-added into the output. Reads the routing on the
host (nonzero), so it is not for CUDA-graph capture; the Triton path is.

FP8 experts (w13/w2 float8_e4m3fn with per-expert, per-output-row float32 scales): W8A8 as the
dense FP8 layers compute it (layers/quant/fp8_ops.fp8_gemm's CPU path). The tokens are quantized
per token (or with a checkpoint's static scale) once, each expert's gate/up product is taken on the
dequantized values in float32 and rounded to the activation dtype, silu(gate) * up is quantized per
row (one row per (token, slot) pair), and the down product likewise. The fp8 values and the scales
are exact in float32, so this differs from the Triton kernel (scales applied to the float32
accumulator) only by summation order.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from pagedserve.layers.quant.fp8_format import FP8_DTYPE


def quantize_activations(x: torch.Tensor, static_scale: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp8 [M, K], float32 scale [M, 1]): per token, or with the checkpoint's one static scale."""
    from pagedserve.layers.quant.fp8_ops import quantize_per_token, quantize_static
    return quantize_per_token(x) if static_scale is None else quantize_static(x, static_scale)


def _dequant_linear(xq, x_scale, wq, w_scale, out_dtype) -> torch.Tensor:
    return ((xq.float() * x_scale) @ (wq.float() * w_scale[:, None]).t()).to(out_dtype)


def fused_experts_torch(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                        topk_ids: torch.Tensor, w13_scale: torch.Tensor | None = None,
                        w2_scale: torch.Tensor | None = None, a13_scale: torch.Tensor | None = None,
                        a2_scale: torch.Tensor | None = None) -> torch.Tensor:
    """sum_k w[t, k] * expert_{ids[t, k]}(x[t]) for x [T, H], w13 [E, 2I, H] (gate rows, then up),
    w2 [E, H, I], topk_weights [T, top_k] (any float dtype), topk_ids [T, top_k] in [0, E]; a pair
    with id E is dropped (another rank's expert under expert parallelism).
    FP8 experts: w13_scale [E, 2I], w2_scale [E, H] (float32, real = fp8 * scale); a13_scale /
    a2_scale: static per-tensor activation scales of the two GEMMs' inputs, None for per token."""
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        raise RuntimeError("the torch MoE path reads the routing on the host and cannot be captured in a "
                           "CUDA graph: use the Triton path (PAGEDSERVE_FUSED_MOE unset) or enforce_eager")
    fp8 = w13.dtype == FP8_DTYPE
    if fp8 and (w13_scale is None or w2_scale is None):
        raise ValueError("FP8 experts need w13_scale and w2_scale")
    out = torch.zeros_like(x)
    num_experts = w13.shape[0]
    ids = topk_ids.long()
    hit = torch.zeros(num_experts + 1, dtype=torch.bool, device=x.device)
    hit[ids.reshape(-1)] = True
    if fp8:
        xq, xs = quantize_activations(x, a13_scale)
    for e in hit[:num_experts].nonzero().flatten().tolist():
        token, slot = torch.where(ids == e)
        if fp8:
            gate, up = _dequant_linear(xq[token], xs[token], w13[e], w13_scale[e], x.dtype).chunk(2, dim=-1)
            aq, a_s = quantize_activations(F.silu(gate) * up, a2_scale)
            y = _dequant_linear(aq, a_s, w2[e], w2_scale[e], x.dtype)
        else:
            gate, up = F.linear(x[token], w13[e]).chunk(2, dim=-1)
            y = F.linear(F.silu(gate) * up, w2[e])
        y = y * topk_weights[token, slot, None]
        out.index_add_(0, token, y.to(out.dtype))
    return out


def fused_experts_naive(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                        topk_ids: torch.Tensor, w13_scale: torch.Tensor | None = None,
                        w2_scale: torch.Tensor | None = None) -> torch.Tensor:
    """The definition, one (token, slot) at a time in float64: for tests only. FP8 experts: the
    weights dequantized (fp8 * scale), and each GEMM's input row rounded to fp8 with its own
    per-row scale (amax / 448) after rounding to x's dtype, which is what W8A8 means."""
    from pagedserve.layers.quant.fp8_ops import dequantize, quantize_per_token_torch

    def act(v: torch.Tensor) -> torch.Tensor:  # [K] float64 -> the GEMM's input as it is multiplied
        if w13_scale is None:
            return v
        q, s = quantize_per_token_torch(v.to(x.dtype)[None])
        return dequantize(q, s)[0].double()

    if w13_scale is not None:
        w13 = dequantize(w13, w13_scale[:, :, None])
        w2 = dequantize(w2, w2_scale[:, :, None])
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for k in range(topk_ids.shape[1]):
            e = int(topk_ids[t, k])
            if e == w13.shape[0]:  # dropped
                continue
            gate, up = (w13[e].double() @ act(x[t].double())).chunk(2)
            out[t] += float(topk_weights[t, k]) * (w2[e].double() @ act(F.silu(gate) * up))
    return out
