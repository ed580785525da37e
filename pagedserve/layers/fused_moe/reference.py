"""The plain torch MoE: the CPU path and the oracle for the Triton kernels.

A loop over the experts that received a pair, in expert order, as HF transformers computes it:
gate and up projections each rounded to the activation dtype, silu(gate) * up, the down
projection, times the routing weight, index-added into the output. Reads the routing on the
host (nonzero), so it is not for CUDA-graph capture; the Triton path is.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def fused_experts_torch(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                        topk_ids: torch.Tensor) -> torch.Tensor:
    """sum_k w[t, k] * expert_{ids[t, k]}(x[t]) for x [T, H], w13 [E, 2I, H] (gate rows, then up),
    w2 [E, H, I], topk_weights [T, top_k] (any float dtype), topk_ids [T, top_k] in [0, E]; a pair
    with id E is dropped (another rank's expert under expert parallelism)."""
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        raise RuntimeError("the torch MoE path reads the routing on the host and cannot be captured in a "
                           "CUDA graph: use the Triton path (PAGEDSERVE_FUSED_MOE unset) or enforce_eager")
    out = torch.zeros_like(x)
    num_experts = w13.shape[0]
    ids = topk_ids.long()
    hit = torch.zeros(num_experts + 1, dtype=torch.bool, device=x.device)
    hit[ids.reshape(-1)] = True
    for e in hit[:num_experts].nonzero().flatten().tolist():
        token, slot = torch.where(ids == e)
        gate, up = F.linear(x[token], w13[e]).chunk(2, dim=-1)
        y = F.linear(F.silu(gate) * up, w2[e])
        y = y * topk_weights[token, slot, None]
        out.index_add_(0, token, y.to(out.dtype))
    return out


def fused_experts_naive(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                        topk_ids: torch.Tensor) -> torch.Tensor:
    """The definition, one (token, slot) at a time in float64: for tests only."""
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for k in range(topk_ids.shape[1]):
            e = int(topk_ids[t, k])
            if e == w13.shape[0]:  # dropped
                continue
            gate, up = (w13[e].double() @ x[t].double()).chunk(2)
            out[t] += float(topk_weights[t, k]) * (w2[e].double() @ (F.silu(gate) * up))
    return out
