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

What the expert weights are (model dtype, or FP8 with per-expert per-channel scales) is the
quant_method's business (layers/quant: UnquantizedMoEMethod, fp8_moe.Fp8MoEMethod), as for the
linear layers; the layer only knows how its rank's rows map onto the checkpoint's (local_expert,
shard_rows). The router stays in the model dtype: the model owns it, unquantized.
"""
from __future__ import annotations

import torch
from torch import nn

from pagedserve.distributed import all_reduce
from pagedserve.layers.fused import fused_moe_ops
from pagedserve.layers.fused_moe.reference import fused_experts_torch
from pagedserve.layers.fused_moe.routing import select_experts
from pagedserve.layers.linear import divide
from pagedserve.layers.quant.base import QuantizationConfig, UnquantizedMoEMethod
from pagedserve.layers.weights import copy_checked, narrow


def fused_experts(x, w13, w2, topk_weights, topk_ids, may_drop: bool = False, **quant) -> torch.Tensor:
    """The experts' weighted sum: the Triton grouped GEMM where fused_moe_ops has it, else torch.
    may_drop: ids equal to the number of experts are dropped pairs. quant: FP8 scales
    (w13_scale, w2_scale, a13_scale, a2_scale; see reference.fused_experts_torch)."""
    ops = fused_moe_ops(x.device)
    if ops is not None:
        return ops.fused_experts(x, w13, w2, topk_weights, topk_ids, may_drop=may_drop, **quant)
    return fused_experts_torch(x, w13, w2, topk_weights, topk_ids, **quant)


class FusedMoE(nn.Module):
    def __init__(self, num_experts: int, top_k: int, hidden_size: int, intermediate_size: int,
                 renormalize: bool, round_weights: bool, tp_rank: int = 0, tp_size: int = 1,
                 reduce_results: bool = True, expert_parallel: bool = False,
                 quant_config: QuantizationConfig | None = None, prefix: str = ""):
        """round_weights: round the routing weights to the activation dtype before use (Qwen-MoE's
        routers do; Mixtral's keep them float32). prefix: the checkpoint name of the experts
        module (model.layers.N.mlp.experts), which a quantization config may list as ignored."""
        super().__init__()
        self.num_experts, self.top_k, self.hidden_size = num_experts, top_k, hidden_size
        self.renormalize, self.round_weights = renormalize, round_weights
        self.tp_rank, self.tp_size, self.reduce_results = tp_rank, tp_size, reduce_results
        self.prefix = prefix
        self.params_dtype = torch.get_default_dtype()  # the activations' dtype (the weights may be fp8)
        self.expert_parallel = expert_parallel and tp_size > 1
        if self.expert_parallel:
            self.num_local_experts = divide(num_experts, tp_size, "num_experts (expert parallelism)")
            self.intermediate_local = intermediate_size
        else:
            self.num_local_experts = num_experts
            self.intermediate_local = divide(intermediate_size, tp_size, "moe intermediate size")
        self.expert_start = tp_rank * self.num_local_experts if self.expert_parallel else 0
        self.quant_method = (UnquantizedMoEMethod() if quant_config is None
                             else quant_config.get_moe_method(self, prefix))
        self.quant_method.create_weights(self)

    @property
    def graph_capturable(self) -> bool:
        """The Triton path reads nothing on the host; the torch path does (runner/cuda_graph.py)."""
        return fused_moe_ops(self.w13_weight.device) is not None

    def local_expert(self, expert_id: int) -> int | None:
        """This rank's index of a checkpoint expert; None if another rank holds it."""
        if not 0 <= expert_id < self.num_experts:
            raise ValueError(f"expert {expert_id} is out of range (num_experts {self.num_experts})")
        local = expert_id - self.expert_start
        return local if 0 <= local < self.num_local_experts else None

    def shard_rows(self, shard_id: str) -> tuple[int, int, int]:
        """(first local row, rows, first checkpoint row) of this rank's output rows of one
        expert's shard: w1/w3 are the gate/up halves of w13's 2I rows, sliced like a column-
        parallel layer; w2's rows (hidden) are whole on every rank."""
        n = self.intermediate_local
        start = 0 if self.expert_parallel else self.tp_rank * n
        if shard_id == "w1":
            return 0, n, start
        if shard_id == "w3":
            return n, n, start
        if shard_id == "w2":
            return 0, self.hidden_size, 0
        raise ValueError(f"FusedMoE shard_id must be w1, w2 or w3, got {shard_id!r}")

    def weight_loader(self, param, loaded_weight, shard_id: str, expert_id: int) -> bool:
        """Copy this rank's part of one expert's tensor; False if the expert lives on another rank."""
        local = self.local_expert(expert_id)
        if local is None:
            return False
        offset, n, start = self.shard_rows(shard_id)
        if shard_id == "w2":  # its input (intermediate) columns are the sharded ones
            n = self.intermediate_local
            start = 0 if self.expert_parallel else self.tp_rank * n
            copy_checked(param.data[local], narrow(loaded_weight, 1, start, n), f"expert {expert_id} w2")
        else:
            copy_checked(param.data[local].narrow(0, offset, n), narrow(loaded_weight, 0, start, n),
                         f"expert {expert_id} {shard_id}")
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
        return fused_experts(x, self.w13_weight, self.w2_weight, weights, ids, may_drop=self.expert_parallel,
                             **self.quant_method.kernel_args(self))
