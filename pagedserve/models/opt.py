"""OPT decoders: learned positions (offset 2), LayerNorm blocks (pre-LN, or post-LN for 350m-style
configs), ReLU MLP, and optional project_in/project_out when word_embed_proj_dim != hidden_size.

Module and parameter names follow HF's OPTForCausalLM (model.decoder.*), with q/k/v fused.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedserve.attention import Attention, AttentionMetadata
from pagedserve.layers.linear import (ColumnParallelLinear, ParallelLMHead, QKVParallelLinear, ReplicatedLinear,
                                      RowParallelLinear, VocabParallelEmbedding)
from pagedserve.layers.norm import LayerNorm

KVCache = tuple[torch.Tensor, torch.Tensor]
POSITION_OFFSET = 2  # OPT was trained with positions starting at 2 (padding_idx quirk of fairseq)
_ACTS = {"relu": F.relu, "gelu": F.gelu, "gelu_new": lambda x: F.gelu(x, approximate="tanh"), "silu": F.silu}


class OPTAttention(nn.Module):
    def __init__(self, config, tp_rank: int, tp_size: int):
        super().__init__()
        heads = config.num_attention_heads
        self.head_dim = config.hidden_size // heads
        bias = bool(getattr(config, "enable_bias", True))
        self.qkv_proj = QKVParallelLinear(config.hidden_size, self.head_dim, heads, heads, bias, tp_rank, tp_size)
        self.out_proj = RowParallelLinear(config.hidden_size, config.hidden_size, bias, tp_rank, tp_size)
        n = self.qkv_proj.num_heads
        self.attn = Attention(n, n, self.head_dim, self.head_dim ** -0.5, total_num_kv_heads=heads,
                              kv_head_start=self.qkv_proj.kv_head_start)

    def forward(self, x, kv_cache: KVCache, meta: AttentionMetadata) -> torch.Tensor:
        q, k, v = self.qkv_proj.split(self.qkv_proj(x))
        return self.out_proj(self.attn(q, k, v, kv_cache[0], kv_cache[1], meta))


class OPTDecoderLayer(nn.Module):
    def __init__(self, config, tp_rank: int, tp_size: int):
        super().__init__()
        self.pre_ln = bool(config.do_layer_norm_before)
        affine = bool(getattr(config, "layer_norm_elementwise_affine", True))
        bias = bool(getattr(config, "enable_bias", True))
        act = config.activation_function
        if act not in _ACTS:
            raise ValueError(f"activation_function {act!r} is not supported; supported: {sorted(_ACTS)}")
        self.act = _ACTS[act]
        self.self_attn = OPTAttention(config, tp_rank, tp_size)
        self.self_attn_layer_norm = LayerNorm(config.hidden_size, elementwise_affine=affine)
        self.fc1 = ColumnParallelLinear(config.hidden_size, config.ffn_dim, bias, tp_rank, tp_size)
        self.fc2 = RowParallelLinear(config.ffn_dim, config.hidden_size, bias, tp_rank, tp_size)
        self.final_layer_norm = LayerNorm(config.hidden_size, elementwise_affine=affine)

    def forward(self, x, kv_cache: KVCache, meta: AttentionMetadata) -> torch.Tensor:
        h = self.self_attn_layer_norm(x) if self.pre_ln else x
        x = x + self.self_attn(h, kv_cache, meta)
        if not self.pre_ln:
            x = self.self_attn_layer_norm(x)
        h = self.final_layer_norm(x) if self.pre_ln else x
        x = x + self.fc2(self.act(self.fc1(h)))
        return x if self.pre_ln else self.final_layer_norm(x)


class OPTDecoder(nn.Module):
    def __init__(self, config, tp_rank: int, tp_size: int):
        super().__init__()
        proj_dim = config.word_embed_proj_dim
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, proj_dim, tp_rank, tp_size)
        # Positions are learned and small: replicated.
        self.embed_positions = VocabParallelEmbedding(config.max_position_embeddings + POSITION_OFFSET,
                                                      config.hidden_size)
        if proj_dim != config.hidden_size:
            self.project_in = ReplicatedLinear(proj_dim, config.hidden_size, bias=False)
            self.project_out = ReplicatedLinear(config.hidden_size, proj_dim, bias=False)
        else:
            self.project_in = self.project_out = None
        if config.do_layer_norm_before and not getattr(config, "_remove_final_layer_norm", False):
            self.final_layer_norm = LayerNorm(config.hidden_size,
                                              elementwise_affine=bool(getattr(config, "layer_norm_elementwise_affine",
                                                                              True)))
        else:
            self.final_layer_norm = None
        self.layers = nn.ModuleList(OPTDecoderLayer(config, tp_rank, tp_size) for _ in range(config.num_hidden_layers))

    def forward(self, input_ids, positions, kv_caches: list[KVCache], meta: AttentionMetadata) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        if self.project_in is not None:
            x = self.project_in(x)
        x = x + self.embed_positions(positions + POSITION_OFFSET)
        for layer, kv in zip(self.layers, kv_caches):
            x = layer(x, kv, meta)
        if self.final_layer_norm is not None:
            x = self.final_layer_norm(x)
        if self.project_out is not None:
            x = self.project_out(x)
        return x


class OPTModel(nn.Module):
    def __init__(self, config, tp_rank: int, tp_size: int):
        super().__init__()
        self.decoder = OPTDecoder(config, tp_rank, tp_size)


class OPTForCausalLM(nn.Module):
    stacked_params = [("qkv_proj", "q_proj", "q"), ("qkv_proj", "k_proj", "k"), ("qkv_proj", "v_proj", "v")]

    def __init__(self, config, tp_rank: int = 0, tp_size: int = 1):
        super().__init__()
        self.config = config
        self.model = OPTModel(config, tp_rank, tp_size)
        self.lm_head = ParallelLMHead(config.vocab_size, config.word_embed_proj_dim, tp_rank=tp_rank, tp_size=tp_size)
        if getattr(config, "tie_word_embeddings", True):
            self.lm_head.tie(self.model.decoder.embed_tokens)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[KVCache],
                attn_meta: AttentionMetadata) -> torch.Tensor:
        """Returns [T, word_embed_proj_dim] (after project_out): what the lm_head consumes."""
        return self.model.decoder(input_ids, positions, kv_caches, attn_meta)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)
