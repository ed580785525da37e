"""OLMo 2 (Olmo2ForCausalLM: AI2's fully open 1B-32B models).

Llama's projections, attention and SwiGLU MLP, with the norms moved: none before the attention or
the MLP; their outputs are normalised before they join the residual stream (x + norm(attn(x)),
x + norm(mlp(x))), and q and k are RMS-normalised over their whole projection (all heads at
once, before the split into heads and the rotary). Norms multiply their weight in float32 as
HF's (Fp32WeightRMSNorm).

Under tensor parallelism a rank holds some heads, so that norm's mean square spans ranks: each
rank sums the squares of its slice of q and of k, one all-reduce of those two numbers per token
gives every rank the full-width sums, and each rank scales its slice with its slice of the norm
weights (Olmo2Attention.project).
"""
from __future__ import annotations

import torch
from torch import nn

from pagedserve.attention import AttentionMetadata
from pagedserve.distributed import all_reduce
from pagedserve.layers.linear import ParallelLMHead, VocabParallelEmbedding
from pagedserve.layers.norm import Fp32WeightRMSNorm
from pagedserve.layers.rotary import Rope, RotaryEmbedding
from pagedserve.layers.weights import copy_checked, narrow
from pagedserve.models.hf_dir import rope_parameters
from pagedserve.models.llama import KVCache, LlamaAttention, LlamaForCausalLM, LlamaMLP, head_dim_of


def rows_loader(start: int, rows: int):
    """A weight_loader reading checkpoint rows [start, start + rows): a norm weight's part that
    matches the heads this rank holds."""
    def load(param, loaded_weight, shard_id=None) -> None:
        copy_checked(param.data, narrow(loaded_weight, 0, start, rows), "norm weight")
    return load


def partial_sums_of_squares(q: torch.Tensor, k: torch.Tensor, count_k: bool) -> torch.Tensor:
    """[T, 2] float32: this rank's part of each token's sum of squares of q and of k. count_k
    False (a rank whose KV head another rank also holds and counts): k's part is 0, so the
    all-reduced sum counts each distinct KV head once."""
    q_sum = q.float().square().sum(-1)
    k_sum = k.float().square().sum(-1) if count_k else torch.zeros_like(q_sum)
    return torch.stack([q_sum, k_sum], dim=-1)


def normalize_slice(x: torch.Tensor, sum_sq: torch.Tensor, width: int, weight: torch.Tensor,
                    eps: float) -> torch.Tensor:
    """x [T, part of width] RMS-normalised by the full width's sum of squares sum_sq [T, 1], times
    its part of the weight; in float32 and rounded once, as HF's Olmo2RMSNorm."""
    return (x.float() * torch.rsqrt(sum_sq / width + eps) * weight.float()).to(x.dtype)


class Olmo2Attention(LlamaAttention):
    def __init__(self, config, tp_rank: int, tp_size: int, quant_config=None, prefix: str = ""):
        bias = bool(getattr(config, "attention_bias", False))
        super().__init__(config, bias, bias, False, tp_rank, tp_size, quant_config, prefix)
        self.eps, self.tp_size = config.rms_norm_eps, tp_size
        qkv = self.qkv_proj
        total_kv = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        # The full widths the mean squares divide by, and this rank's slices of the norm weights:
        # the checkpoint rows of the heads it holds (the rows its q/k projection reads).
        self.q_width, self.k_width = config.num_attention_heads * self.head_dim, total_kv * self.head_dim
        self.q_norm = Fp32WeightRMSNorm(qkv.q_size, self.eps)
        self.k_norm = Fp32WeightRMSNorm(qkv.kv_size, self.eps)
        for norm, shard in ((self.q_norm, "q"), (self.k_norm, "k")):
            _, rows, start = qkv.shard_rows(shard)
            norm.weight.weight_loader = rows_loader(start, rows)
        # With fewer KV heads than ranks each KV head sits on tp_size // total_kv ranks; the first
        # of them adds its k squares to the all-reduce, the others add 0.
        self.count_k = total_kv >= tp_size or tp_rank % (tp_size // total_kv) == 0

    def project(self, x: torch.Tensor):
        q, k, v = super().project(x)
        T = q.shape[0]
        q, k = q.reshape(T, -1), k.reshape(T, -1)
        if self.tp_size == 1:  # the whole width here: the norm's own (fused on CUDA) kernel
            q, k = self.q_norm(q), self.k_norm(k)
        else:
            # All-reduce each token's two sums of squares ([T, 2] float32) rather than all-gather q
            # and k, norm the whole width and keep this rank's part, as vLLM does: 2 numbers a
            # token cross the ranks instead of every head's q and k (8192 a token for OLMo-2-7B's
            # 32 + 32 heads of 128), and no rank normalises heads it then drops. It goes through
            # the same all_reduce as the row-parallel linears, so CUDA graphs capture it as theirs.
            sums = all_reduce(partial_sums_of_squares(q, k, self.count_k), self.tp_size)
            q = normalize_slice(q, sums[:, :1], self.q_width, self.q_norm.weight, self.eps)
            k = normalize_slice(k, sums[:, 1:], self.k_width, self.k_norm.weight, self.eps)
        return q.view(T, self.num_heads, self.head_dim), k.view(T, self.num_kv_heads, self.head_dim), v

    def rope(self, cos: torch.Tensor, sin: torch.Tensor) -> Rope:
        return Rope(cos, sin)  # the norms were applied in project, over the whole width


class Olmo2DecoderLayer(nn.Module):
    def __init__(self, config, tp_rank: int, tp_size: int, quant_config=None, prefix: str = ""):
        super().__init__()
        self.self_attn = Olmo2Attention(config, tp_rank, tp_size, quant_config, f"{prefix}.self_attn")
        self.mlp = LlamaMLP(config, tp_rank, tp_size, quant_config=quant_config, prefix=f"{prefix}.mlp")
        self.post_attention_layernorm = Fp32WeightRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_feedforward_layernorm = Fp32WeightRMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x: torch.Tensor, cos, sin, kv_cache: KVCache, meta: AttentionMetadata) -> torch.Tensor:
        q, k, v = self.self_attn.project(x)
        out = self.self_attn.attn(q, k, v, kv_cache[0], kv_cache[1], meta, self.self_attn.rope(cos, sin))
        x = x + self.post_attention_layernorm(self.self_attn.o_proj(out))
        return x + self.post_feedforward_layernorm(self.mlp(x))


class Olmo2Model(nn.Module):
    def __init__(self, config, tp_rank: int, tp_size: int, quant_config=None):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp_rank, tp_size)
        self.layers = nn.ModuleList(Olmo2DecoderLayer(config, tp_rank, tp_size, quant_config, f"model.layers.{i}")
                                    for i in range(config.num_hidden_layers))
        self.norm = Fp32WeightRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(head_dim_of(config), rope_parameters(config), 1.0,
                                          config.max_position_embeddings)

    def forward(self, input_ids, positions, kv_caches: list[KVCache], meta: AttentionMetadata) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        cos, sin = self.rotary_emb(positions, x.dtype)
        for layer, kv in zip(self.layers, kv_caches):
            x = layer(x, cos, sin, kv, meta)
        return self.norm(x)


class Olmo2ForCausalLM(LlamaForCausalLM):
    """LlamaForCausalLM's loading (fused q/k/v and gate/up) and head; the OLMo 2 decoder."""

    def __init__(self, config, tp_rank: int = 0, tp_size: int = 1, quant_config=None):
        nn.Module.__init__(self)
        self.config = config
        self.model = Olmo2Model(config, tp_rank, tp_size, quant_config)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, tp_rank=tp_rank, tp_size=tp_size)
        if getattr(config, "tie_word_embeddings", False):
            self.lm_head.tie(self.model.embed_tokens)
