"""FusedMoE: a mixture-of-experts MLP as one layer (router outside: the model owns its gate).

Parameters, per rank: w13_weight [E_local, 2 * I_local, H] (each expert's gate rows, then its up
rows) and w2_weight [E_local, H, I_local]. Tensor parallelism (the default) shards every expert's
intermediate dimension, as the dense MLP's: E_local = E, I_local = I / tp_size. Expert
parallelism (expert_parallel=True, vLLM's enable_expert_parallel) gives each rank whole experts
instead: E_local = E / tp_size (rank r holds experts r*E_local ..), I_local = I; the router is
replicated, and a rank drops the pairs routed to other ranks' experts. Either way each rank
computes a partial sum of the full output, and one all-reduce per layer adds them
(reduce_results=False leaves it to the caller, which Qwen2-MoE uses to add its shared expert's
partial first).

weight_loader(param, loaded, shard_id, expert_id) reads one expert's HF tensor: shard_id "w1"
(gate_proj), "w3" (up_proj) or "w2" (down_proj), Mixtral's names; a rank reads only its slice,
and under expert parallelism only its own experts (it returns False for the others).
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


def fused_experts(x, w13, w2, topk_weights, topk_ids, may_drop: bool = False) -> torch.Tensor:
    """The experts' weighted sum: the Triton grouped GEMM where fused_moe_ops has it, else torch.
    may_drop: ids equal to the number of experts are dropped pairs."""
    ops = fused_moe_ops(x.device)
    if ops is not None:
        return ops.fused_experts(x, w13, w2, topk_weights, topk_ids, may_drop=may_drop)
    return fused_experts_torch(x, w13, w2, topk_weights, topk_ids)


class FusedMoE(nn.Module):
    def __init__(self, num_experts: int, top_k: int, hidden_size: int, intermediate_size: int,
                 renormalize: bool, round_weights: bool, tp_rank: int = 0, tp_size: int = 1,
                 reduce_results: bool = True, expert_parallel: bool = False):
        """round_weights: round the routing weights to the activation dtype before use (Qwen-MoE's
        routers do; Mixtral's keep them float32)."""
        super().__init__()
        self.num_experts, self.top_k = num_experts, top_k
        self.renormalize, self.round_weights = renormalize, round_weights
        self.tp_rank, self.tp_size, self.reduce_results = tp_rank, tp_size, reduce_results
        self.expert_parallel = expert_parallel and tp_size > 1
        if self.expert_parallel:
            self.num_local_experts = divide(num_experts, tp_size, "num_experts (expert parallelism)")
            self.intermediate_local = intermediate_size
        else:
            self.num_local_experts = num_experts
            self.intermediate_local = divide(intermediate_size, tp_size, "moe intermediate size")
        self.expert_start = tp_rank * self.num_local_experts if self.expert_parallel else 0
        self.w13_weight = nn.Parameter(torch.empty(self.num_local_experts, 2 * self.intermediate_local, hidden_size),
                                       requires_grad=False)
        self.w2_weight = nn.Parameter(torch.empty(self.num_local_experts, hidden_size, self.intermediate_local),
                                      requires_grad=False)
        self.w13_weight.weight_loader = self.weight_loader
        self.w2_weight.weight_loader = self.weight_loader

    @property
    def graph_capturable(self) -> bool:
        """The Triton path reads nothing on the host; the torch path does (runner/cuda_graph.py)."""
        return fused_moe_ops(self.w13_weight.device) is not None

    def weight_loader(self, param, loaded_weight, shard_id: str, expert_id: int) -> bool:
        """Copy this rank's part of one expert's tensor; False if the expert lives on another rank."""
        if not 0 <= expert_id < self.num_experts:
            raise ValueError(f"expert {expert_id} is out of range (num_experts {self.num_experts})")
        local = expert_id - self.expert_start
        if not 0 <= local < self.num_local_experts:
            return False
        n = self.intermediate_local
        start = 0 if self.expert_parallel else self.tp_rank * n
        if shard_id in ("w1", "w3"):
            offset = 0 if shard_id == "w1" else n
            copy_checked(param.data[local].narrow(0, offset, n), narrow(loaded_weight, 0, start, n),
                         f"expert {expert_id} {shard_id}")
        elif shard_id == "w2":
            copy_checked(param.data[local], narrow(loaded_weight, 1, start, n), f"expert {expert_id} w2")
        else:
            raise ValueError(f"FusedMoE shard_id must be w1, w2 or w3, got {shard_id!r}")
        return True

    def forward(self, x: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        out = self.partial(x, router_logits)
        return all_reduce(out, self.tp_size) if self.reduce_results else out

    def partial(self, x: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        """This rank's share of the output, before any all-reduce."""
        weights, ids = select_experts(router_logits, self.top_k, self.renormalize)
        if self.round_weights:
            weights = weights.to(x.dtype)
        if self.expert_parallel:  # other ranks' experts -> the dropped id, num_local_experts
            local = ids - self.expert_start
            ids = torch.where((local >= 0) & (local < self.num_local_experts), local, self.num_local_experts)
        return fused_experts(x, self.w13_weight, self.w2_weight, weights, ids, may_drop=self.expert_parallel)
