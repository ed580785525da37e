"""Routing: which top_k experts each token goes to, and with what weight.

softmax over the router logits in float32, the top_k probabilities, and (renormalize=True:
Mixtral, and Qwen-MoE checkpoints with norm_topk_prob) those divided by their sum. This is
exactly the arithmetic of HF's routers; the weights stay float32 here and the caller rounds them
where its model does (Qwen-MoE rounds them to the activation dtype, Mixtral does not).

On CUDA (or under TRITON_INTERPRET with PAGEDSERVE_FUSED_MOE=force) one Triton kernel does the
softmax, the top-k and the renormalisation per token (triton_moe.route); torch elsewhere.
Both return ids as int32, in descending order of weight, the k experts distinct.
"""
from __future__ import annotations

import torch

from pagedserve.layers.fused import fused_moe_ops


def select_experts_torch(router_logits: torch.Tensor, top_k: int,
                         renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids.to(torch.int32)


def select_experts(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, top_k] float32, expert ids [T, top_k] int32) for router_logits [T, E]."""
    num_experts = router_logits.shape[-1]
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"num_experts_per_tok ({top_k}) must be in [1, num_experts ({num_experts})]")
    ops = fused_moe_ops(router_logits.device)
    if ops is not None:
        return ops.route(router_logits, top_k, renormalize)
    return select_experts_torch(router_logits, top_k, renormalize)
