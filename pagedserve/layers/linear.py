"""Tensor-parallel-aware linear layers (Megatron-style splits).

Each layer owns only its rank's slice of the full weight and exposes
weight_loader(param, loaded_weight, shard_id) which reads that slice (and nothing
else) from a full checkpoint tensor or a safetensors slice. At tp_size == 1 every
layer is a plain F.linear and no collective is ever called.

Weights are [out_features, in_features] as in nn.Linear/HF checkpoints. What a layer's weight
is (plain, or fp8 with scales) is its quant_method's business (layers/quant); the layer only
knows how its rank's rows and columns map onto the checkpoint's (shard_rows, weight_loader).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedserve.distributed import all_gather, all_reduce
from pagedserve.layers.quant.base import QuantizationConfig, UnquantizedLinearMethod
from pagedserve.layers.weights import copy_checked, loaded_shape, materialize, narrow


def divide(a: int, b: int, what: str = "size") -> int:
    if a % b:
        raise ValueError(f"{what} ({a}) must be divisible by tensor_parallel_size ({b})")
    return a // b


class _Linear(nn.Module):
    """prefix: the layer's checkpoint name (e.g. model.layers.0.self_attn.qkv_proj), which a
    quantization config may list as not quantized; checkpoint_parts: the checkpoint's names of
    its fused parts (q_proj, k_proj, v_proj), for the same purpose."""
    checkpoint_parts: tuple[str, ...] = ()

    def __init__(self, in_features: int, out_features: int, bias: bool, tp_rank: int, tp_size: int,
                 quant_config: QuantizationConfig | None = None, prefix: str = ""):
        super().__init__()
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.in_features, self.out_features = in_features, out_features
        self.prefix = prefix
        self.quant_method = (UnquantizedLinearMethod() if quant_config is None
                             else quant_config.get_linear_method(self, prefix))
        self.quant_method.create_weights(self)
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False)
            self.bias.weight_loader = self.weight_loader
        else:
            self.register_parameter("bias", None)

    def shard_rows(self, shard_id=None) -> tuple[int, int, int]:
        """(first local row, rows, first checkpoint row) of this rank's part of shard_id's rows."""
        return 0, self.out_features, 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.quant_method.apply(self, x, self.bias)


class ReplicatedLinear(_Linear):
    def __init__(self, in_features: int, out_features: int, bias: bool = False, tp_rank: int = 0, tp_size: int = 1,
                 quant_config: QuantizationConfig | None = None, prefix: str = ""):
        super().__init__(in_features, out_features, bias, tp_rank, tp_size, quant_config, prefix)

    def weight_loader(self, param, loaded_weight, shard_id=None) -> None:
        copy_checked(param.data, materialize(loaded_weight))


class ColumnParallelLinear(_Linear):
    """Output features split across ranks; output stays sharded unless gather_output."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False, tp_rank: int = 0,
                 tp_size: int = 1, gather_output: bool = False, quant_config: QuantizationConfig | None = None,
                 prefix: str = ""):
        super().__init__(in_features, divide(out_features, tp_size, "output features"), bias, tp_rank, tp_size,
                         quant_config, prefix)
        self.gather_output = gather_output

    def shard_rows(self, shard_id=None) -> tuple[int, int, int]:
        return 0, self.out_features, self.tp_rank * self.out_features

    def weight_loader(self, param, loaded_weight, shard_id=None) -> None:
        offset, n, start = self.shard_rows(shard_id)
        what = "weight" if shard_id is None else f"shard {shard_id}"
        copy_checked(param.data.narrow(0, offset, n), narrow(loaded_weight, 0, start, n), what)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.quant_method.apply(self, x, self.bias)
        return all_gather(y, -1, self.tp_size) if self.gather_output else y


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel matrices fused along the output (e.g. gate_proj and up_proj).

    shard_id is the index of the sub-matrix; each rank stores its slice of every sub-matrix,
    concatenated in order, so the local output splits as [o // tp for o in output_sizes].
    """

    def __init__(self, in_features: int, output_sizes: list[int], bias: bool = False, tp_rank: int = 0,
                 tp_size: int = 1, quant_config: QuantizationConfig | None = None, prefix: str = "",
                 checkpoint_parts: tuple[str, ...] = ()):
        for o in output_sizes:
            divide(o, tp_size, "output features")
        self.output_sizes = list(output_sizes)
        self.checkpoint_parts = checkpoint_parts
        super().__init__(in_features, sum(output_sizes), bias, tp_rank, tp_size, quant_config=quant_config,
                         prefix=prefix)

    def shard_rows(self, shard_id=None) -> tuple[int, int, int]:
        if shard_id is None:
            raise ValueError("MergedColumnParallelLinear needs a shard_id")
        local = [o // self.tp_size for o in self.output_sizes]
        n = local[shard_id]
        return sum(local[:shard_id]), n, self.tp_rank * n


class QKVParallelLinear(ColumnParallelLinear):
    """q, k, v projections fused; heads split across ranks.

    With fewer KV heads than ranks, each KV head is replicated on tp_size // num_kv_heads ranks
    and a rank keeps one KV head.
    """

    checkpoint_parts = ("q_proj", "k_proj", "v_proj")

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool = False,
                 tp_rank: int = 0, tp_size: int = 1, quant_config: QuantizationConfig | None = None,
                 prefix: str = ""):
        self.head_dim = head_dim
        self.num_heads = divide(num_heads, tp_size, "num_attention_heads")
        if num_kv_heads >= tp_size:
            self.num_kv_heads = divide(num_kv_heads, tp_size, "num_key_value_heads")
            self.kv_head_start = tp_rank * self.num_kv_heads
        else:
            divide(tp_size, num_kv_heads, "tensor_parallel_size vs num_key_value_heads")
            self.num_kv_heads = 1
            self.kv_head_start = tp_rank // (tp_size // num_kv_heads)
        out = (self.num_heads + 2 * self.num_kv_heads) * head_dim
        self.q_size, self.kv_size = self.num_heads * head_dim, self.num_kv_heads * head_dim
        # out is already per-rank: build as a "size 1" column layer of that width.
        _Linear.__init__(self, hidden_size, out, bias, tp_rank, tp_size, quant_config, prefix)
        self.gather_output = False

    def shard_rows(self, shard_id=None) -> tuple[int, int, int]:
        d = self.head_dim
        if shard_id == "q":
            return 0, self.q_size, self.tp_rank * self.num_heads * d
        if shard_id in ("k", "v"):
            offset = self.q_size + (0 if shard_id == "k" else self.kv_size)
            return offset, self.kv_size, self.kv_head_start * d
        raise ValueError(f"QKVParallelLinear shard_id must be 'q', 'k' or 'v', got {shard_id!r}")

    def weight_loader(self, param, loaded_weight, shard_id=None) -> None:
        offset, n, start = self.shard_rows(shard_id)
        copy_checked(param.data.narrow(0, offset, n), narrow(loaded_weight, 0, start, n), f"{shard_id}_proj")

    def split(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)


class RowParallelLinear(_Linear):
    """Input features split across ranks; partial outputs summed (all-reduce), bias added once after."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False, tp_rank: int = 0,
                 tp_size: int = 1, reduce_results: bool = True, quant_config: QuantizationConfig | None = None,
                 prefix: str = ""):
        super().__init__(divide(in_features, tp_size, "input features"), out_features, bias, tp_rank, tp_size,
                         quant_config, prefix)
        self.reduce_results = reduce_results

    def weight_loader(self, param, loaded_weight, shard_id=None) -> None:
        if param.dim() == 1:  # bias: replicated
            copy_checked(param.data, materialize(loaded_weight), "bias")
            return
        n = param.shape[1]
        copy_checked(param.data, narrow(loaded_weight, 1, self.tp_rank * n, n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.quant_method.apply(self, x, None)
        if self.reduce_results:
            y = all_reduce(y, self.tp_size)
        return y if self.bias is None else y + self.bias


def _pad_vocab(vocab_size: int, tp_size: int) -> int:
    return -(-vocab_size // tp_size) * tp_size


class VocabParallelEmbedding(nn.Module):
    """Embedding rows split across ranks; a rank zeroes ids it does not own and partials are summed."""

    def __init__(self, num_embeddings: int, embedding_dim: int, tp_rank: int = 0, tp_size: int = 1):
        super().__init__()
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.num_embeddings = num_embeddings
        self.per_rank = _pad_vocab(num_embeddings, tp_size) // tp_size
        self.vocab_start = tp_rank * self.per_rank
        self.weight = nn.Parameter(torch.empty(self.per_rank, embedding_dim), requires_grad=False)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param, loaded_weight, shard_id=None) -> None:
        total = loaded_shape(loaded_weight)[0]
        if total != self.num_embeddings:
            raise ValueError(f"embedding: checkpoint has {total} rows, config vocab_size is {self.num_embeddings}")
        n = max(0, min(self.per_rank, total - self.vocab_start))
        with torch.no_grad():
            if n < self.per_rank:
                param.data[n:].zero_()
            if n:
                copy_checked(param.data[:n], narrow(loaded_weight, 0, self.vocab_start, n))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.vocab_start
        outside = (local < 0) | (local >= self.per_rank)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out.masked_fill_(outside[:, None], 0)
        return all_reduce(out, self.tp_size)


class ParallelLMHead(VocabParallelEmbedding):
    """Output projection with vocab rows split like the embedding (so tying shares the shard)."""

    def __init__(self, num_embeddings: int, embedding_dim: int, bias: bool = False, tp_rank: int = 0,
                 tp_size: int = 1):
        super().__init__(num_embeddings, embedding_dim, tp_rank, tp_size)
        if bias:
            raise ValueError("lm_head bias is not supported")

    def tie(self, embedding: VocabParallelEmbedding) -> None:
        self.weight = embedding.weight

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """Full logits [N, vocab] on every rank (gathered over ranks, padding dropped)."""
        logits = F.linear(hidden, self.weight)
        if self.tp_size > 1:
            logits = all_gather(logits, -1, self.tp_size)
        return logits[..., : self.num_embeddings]
