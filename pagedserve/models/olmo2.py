"""OLMo 2 (Olmo2ForCausalLM: AI2's fully open 1B-32B models).

Llama's projections, attention and SwiGLU MLP, with the norms moved: none before the attention or
the MLP; their outputs are normalised before they join the residual stream (x + norm(attn(x)),
x + norm(mlp(x))), and q and k are RMS-normalised over their whole projection (all heads at
once, before the split into heads and the rotary). That norm spans every head, so a
tensor-parallel rank, which holds some heads, could not compute it alone: TP is refused (vLLM
all-gathers q and k for it). Norms multiply their weight in float32 as HF's (Fp32WeightRMSNorm).
"""
from __future__ import annotations

import torch
from torch import nn

from pagedserve.attention import AttentionMetadata
from pagedserve.layers.linear import ParallelLMHead, VocabParallelEmbedding
from pagedserve.layers.norm import Fp32WeightRMSNorm
from pagedserve.layers.rotary import Rope, RotaryEmbedding
from pagedserve.models.hf_dir import rope_parameters
from pagedserve.models.llama import KVCache, LlamaAttention, LlamaForCausalLM, LlamaMLP, head_dim_of


class Olmo2Attention(LlamaAttention):
    def __init__(self, config, tp_rank: int, tp_size: int, quant_config=None, prefix: str = ""):
        bias = bool(getattr(config, "attention_bias", False))
        super().__init__(config, bias, bias, False, tp_rank, tp_size, quant_config, prefix)
        eps = config.rms_norm_eps
        self.q_norm = Fp32WeightRMSNorm(self.num_heads * self.head_dim, eps)
        self.k_norm = Fp32WeightRMSNorm(self.num_kv_heads * self.head_dim, eps)

    def project(self, x: torch.Tensor):
        q, k, v = super().project(x)
        T = q.shape[0]
        q = self.q_norm(q.reshape(T, -1)).view(T, self.num_heads, self.head_dim)
        k = self.k_norm(k.reshape(T, -1)).view(T, self.num_kv_heads, self.head_dim)
        return q, k, v

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
        if tp_size > 1:
            raise ValueError("tensor_parallel_size: OLMo 2's q/k norms span every head, which one rank does not "
                             "hold; serve it with tensor_parallel_size 1")
        self.config = config
        self.model = Olmo2Model(config, tp_rank, tp_size, quant_config)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, tp_rank=tp_rank, tp_size=tp_size)
        if getattr(config, "tie_word_embeddings", False):
            self.lm_head.tie(self.model.embed_tokens)
