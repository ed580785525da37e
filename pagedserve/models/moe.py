"""Mixture-of-experts decoders: Qwen3-MoE, Qwen2-MoE (shared expert), Mixtral.

The attention blocks, norms and rotary are the Llama family's (models/llama.py); only the MLP
of a sparse layer differs: a router (`gate`, replicated on every rank) picks top_k experts per
token, and FusedMoE (layers/fused_moe) sums their outputs, weighted. Qwen2-MoE adds a dense
shared expert scaled by sigmoid(shared_expert_gate(x)); its partial sum joins the experts'
before the layer's one all-reduce.

Routing per family, as HF computes it: softmax in float32, top_k; renormalised for Mixtral and
for Qwen checkpoints with norm_topk_prob; Qwen's routers round the weights to the activation
dtype, Mixtral's keep float32. Qwen layers listed in mlp_only_layers, or off the
decoder_sparse_step grid, are dense (intermediate_size).

Tensor parallelism splits every expert's intermediate dimension; with expert_parallel
(enable_expert_parallel) each rank holds whole experts instead (layers/fused_moe/layer.py).

FP8 (quant_config): the experts take FP8 weights (layers/quant/fp8_moe.py), the shared expert is
a plain FP8 MLP like the dense layers', the attention projections as in Llama; the routers (`gate`,
`shared_expert_gate`) stay in the model dtype, as vLLM keeps them.

Checkpoint names: experts come one tensor per expert (`...experts.<e>.gate_proj.weight`, Mixtral
`w1`/`w3`/`w2`); load_weights routes them into the fused [E, ...] parameters through
expert_checkpoint_names. Mixtral's `block_sparse_moe` module is our `mlp` (checkpoint_renames).
"""
from __future__ import annotations

import torch
from torch import nn

from pagedserve.distributed import all_reduce
from pagedserve.layers.fused_moe import FusedMoE
from pagedserve.layers.linear import ReplicatedLinear
from pagedserve.models.llama import LlamaForCausalLM, LlamaMLP, check_silu


class SparseMoeBlock(nn.Module):
    def __init__(self, config, num_experts: int, top_k: int, intermediate_size: int, renormalize: bool,
                 round_weights: bool, tp_rank: int, tp_size: int, shared_intermediate_size: int = 0,
                 expert_parallel: bool = False, quant_config=None, prefix: str = ""):
        super().__init__()
        check_silu(config)
        h = config.hidden_size
        self.tp_size = tp_size
        self.gate = ReplicatedLinear(h, num_experts, bias=False)
        shared = shared_intermediate_size > 0
        self.experts = FusedMoE(num_experts, top_k, h, intermediate_size, renormalize, round_weights,
                                tp_rank, tp_size, reduce_results=not shared, expert_parallel=expert_parallel,
                                quant_config=quant_config, prefix=f"{prefix}.experts")
        if shared:
            self.shared_expert = LlamaMLP(config, tp_rank, tp_size, shared_intermediate_size, reduce_results=False,
                                          quant_config=quant_config, prefix=f"{prefix}.shared_expert")
            self.shared_expert_gate = ReplicatedLinear(h, 1, bias=False)
        else:
            self.shared_expert = self.shared_expert_gate = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.experts(x, self.gate(x))
        if self.shared_expert is None:
            return out
        # sigmoid(gate) scales each token: linear in the rank's partial, so it may be applied before the sum.
        shared = torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return all_reduce(out + shared, self.tp_size)


class _MoeForCausalLM(LlamaForCausalLM):
    expert_checkpoint_names = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}
    round_weights = True
    supports_expert_parallel = True

    def __init__(self, config, tp_rank: int = 0, tp_size: int = 1, expert_parallel: bool = False,
                 quant_config=None):
        self.expert_parallel = expert_parallel  # read by make_mlp, during the base constructor
        self.quant_config = quant_config
        super().__init__(config, tp_rank, tp_size, quant_config)

    def is_sparse(self, config, i: int) -> bool:
        step = getattr(config, "decoder_sparse_step", 1) or 1
        return i not in (getattr(config, "mlp_only_layers", None) or []) and (i + 1) % step == 0

    def make_mlp(self, config, layer_index: int, tp_rank: int, tp_size: int) -> nn.Module | None:
        if not self.is_sparse(config, layer_index):
            return None
        return SparseMoeBlock(config, config.num_experts, config.num_experts_per_tok, config.moe_intermediate_size,
                              bool(getattr(config, "norm_topk_prob", False)), self.round_weights, tp_rank, tp_size,
                              getattr(config, "shared_expert_intermediate_size", 0) or 0, self.expert_parallel,
                              self.quant_config, f"model.layers.{layer_index}.mlp")


class Qwen3MoeForCausalLM(_MoeForCausalLM):
    qk_norm = True


class Qwen2MoeForCausalLM(_MoeForCausalLM):
    def __init__(self, config, tp_rank: int = 0, tp_size: int = 1, expert_parallel: bool = False,
                 quant_config=None):
        self.qkv_bias = bool(getattr(config, "qkv_bias", True))  # Qwen1.5-MoE: q/k/v biases
        super().__init__(config, tp_rank, tp_size, expert_parallel, quant_config)


class MixtralForCausalLM(_MoeForCausalLM):
    expert_checkpoint_names = {"w1": "w1", "w3": "w3", "w2": "w2"}
    checkpoint_renames = ((".block_sparse_moe.", ".mlp."),)
    round_weights = False

    def is_sparse(self, config, i: int) -> bool:
        return True

    def make_mlp(self, config, layer_index: int, tp_rank: int, tp_size: int) -> nn.Module:
        return SparseMoeBlock(config, config.num_local_experts, config.num_experts_per_tok,
                              config.intermediate_size, True, self.round_weights, tp_rank, tp_size,
                              expert_parallel=self.expert_parallel, quant_config=self.quant_config,
                              prefix=f"model.layers.{layer_index}.mlp")
