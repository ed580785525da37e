"""FusedMoE: a mixture-of-experts MLP as one layer (router outside: the model owns its gate).

Parameters, per rank: w13_weight [E, 2 * I_local, H] (each expert's gate rows, then its up rows)
and w2_weight [E, H, I_local], I_local = moe_intermediate_size / tp_size. Tensor parallelism
shards every expert's intermediate dimension, as the dense MLP's: each rank computes a partial
sum of the full output, and one all-reduce per layer adds them (reduce_results=False leaves it
to the caller, which Qwen2-MoE uses to add its shared expert's partial first).

weight_loader(param, loaded, shard_id, expert_id) reads one expert's HF tensor: shard_id "w1"
(gate_proj), "w3" (up_proj) or "w2" (down_proj), Mixtral's names; a rank reads only its slice.
"""
from __future__ import annotations

import torch
from torch import nn

from pagedserve.distributed import all_reduce
from pagedserve.layers.fused import fused_moe_ops
from pagedserve.layers.fused_moe.reference import fused_experts_torch
from pagedserve.layers.fused_moe.routing import select_experts
from pagedserve.layers.linear import divide
from pagedserve.layers.weights import copy_checked, narrow


def fused_experts(x, w13, w2, topk_weights, topk_ids) -> torch.Tensor:
    """The experts' weighted sum: the Triton grouped GEMM where fused_moe_ops has it, else torch."""
    ops = fused_moe_ops(x.device)
    if ops is not None:
        return ops.fused_experts(x, w13, w2, topk_weights, topk_ids)
    return fused_experts_torch(x, w13, w2, topk_weights, topk_ids)


class FusedMoE(nn.Module):
    def __init__(self, num_experts: int, top_k: int, hidden_size: int, intermediate_size: int,
                 renormalize: bool, round_weights: bool, tp_rank: int = 0, tp_size: int = 1,
                 reduce_results: bool = True):
        """round_weights: round the routing weights to the activation dtype before use (Qwen-MoE's
        routers do; Mixtral's keep them float32)."""
        super().__init__()
        self.num_experts, self.top_k = num_experts, top_k
        self.renormalize, self.round_weights = renormalize, round_weights
        self.tp_rank, self.tp_size, self.reduce_results = tp_rank, tp_size, reduce_results
        self.intermediate_local = divide(intermediate_size, tp_size, "moe intermediate size")
        self.w13_weight = nn.Parameter(torch.empty(num_experts, 2 * self.intermediate_local, hidden_size),
                                       requires_grad=False)
        self.w2_weight = nn.Parameter(torch.empty(num_experts, hidden_size, self.intermediate_local),
                                      requires_grad=False)
        self.w13_weight.weight_loader = self.weight_loader
        self.w2_weight.weight_loader = self.weight_loader

    @property
    def graph_capturable(self) -> bool:
        """The Triton path reads nothing on the host; the torch path does (runner/cuda_graph.py)."""
        return fused_moe_ops(self.w13_weight.device) is not None

    def weight_loader(self, param, loaded_weight, shard_id: str, expert_id: int) -> None:
        if not 0 <= expert_id < self.num_experts:
            raise ValueError(f"expert {expert_id} is out of range (num_experts {self.num_experts})")
        n = self.intermediate_local
        start = self.tp_rank * n
        if shard_id in ("w1", "w3"):
            offset = 0 if shard_id == "w1" else n
            copy_checked(param.data[expert_id].narrow(0, offset, n), narrow(loaded_weight, 0, start, n),
                         f"expert {expert_id} {shard_id}")
        elif shard_id == "w2":
            copy_checked(param.data[expert_id], narrow(loaded_weight, 1, start, n), f"expert {expert_id} w2")
        else:
            raise ValueError(f"FusedMoE shard_id must be w1, w2 or w3, got {shard_id!r}")

    def forward(self, x: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        weights, ids = select_experts(router_logits, self.top_k, self.renormalize)
        if self.round_weights:
            weights = weights.to(x.dtype)
        out = fused_experts(x, self.w13_weight, self.w2_weight, weights, ids)
        return all_reduce(out, self.tp_size) if self.reduce_results else out
