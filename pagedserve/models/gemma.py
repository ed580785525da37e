"""Gemma 2 (Gemma2ForCausalLM: gemma-2-2b/9b/27b) and Gemma 3's text decoder (Gemma3ForCausalLM:
gemma-3-270m and gemma-3-1b; the larger Gemma 3 checkpoints, Gemma3ForConditionalGeneration, serve
as their text decoder: Gemma3TextOfMultimodal).

Llama's block (models/llama.py: the same projections, attention and fused linears) with:
- four norms a layer: the attention's and the MLP's outputs are normalised before they join the
  residual stream (post_attention_layernorm, post_feedforward_layernorm), beside the input and
  pre-feed-forward norms that take the residual add;
- the query scaled by query_pre_attn_scalar ** -0.5; Gemma 3 only: q/k RMSNorm before the rotary;
- GeGLU (tanh GELU) in place of SwiGLU; embeddings multiplied by sqrt(hidden_size), rounded to
  the embedding's dtype as HF rounds it;
- two kinds of layers (config.layer_types): "sliding_attention" layers (one in two in Gemma 2,
  five in six in Gemma 3) attend through a sliding window, the others to the whole context; in
  Gemma 3 each kind has its own RoPE (the local rope_local_base_freq, the global one linear-scaled
  on the larger models), in Gemma 2 they share one;
- Gemma's RMSNorm multiplies by (1 + weight). The loader stores 1 + weight, so every norm kernel
  serves it unchanged: rounded once to the model's dtype, where HF adds 1 in float32 at every call
  (equal in float32; within one rounding in bf16);
- soft-capped attention scores (attn_logit_softcapping: cap * tanh(score / cap), 50 on Gemma 2,
  in the kernels: Attention's logit_softcap) and final logits (final_logit_softcapping, 30 on
  Gemma 2); None on Gemma 3.
"""
from __future__ import annotations

import math

import torch
from torch import nn

from pagedserve.attention import AttentionMetadata
from pagedserve.layers.activation import gelu_tanh_and_mul
from pagedserve.layers.linear import ParallelLMHead, VocabParallelEmbedding
from pagedserve.layers.norm import Fp32WeightRMSNorm
from pagedserve.layers.rotary import RotaryEmbedding
from pagedserve.layers.weights import default_weight_loader, materialize
from pagedserve.models.hf_dir import per_layer_type, rope_parameters, sliding_windows
from pagedserve.models.llama import KVCache, LlamaAttention, LlamaForCausalLM, LlamaMLP, head_dim_of

def _one_plus_weight_loader(param: torch.Tensor, loaded_weight, shard_id=None) -> None:
    default_weight_loader(param, materialize(loaded_weight).float() + 1.0)


class GemmaRMSNorm(Fp32WeightRMSNorm):
    """x / rms(x) * (1 + w), its weight holding 1 + w (the module docstring says why)."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__(dim, eps)
        self.weight.weight_loader = _one_plus_weight_loader


class GemmaMLP(LlamaMLP):
    @staticmethod
    def check_activation(config) -> None:
        act = getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", "gelu_pytorch_tanh")
        if act != "gelu_pytorch_tanh":
            raise ValueError(f"hidden_activation {act!r} is not supported (gelu_pytorch_tanh)")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(gelu_tanh_and_mul(self.gate_up_proj(x)))


class GemmaDecoderLayer(nn.Module):
    def __init__(self, config, window: int, qk_norm: bool, tp_rank: int, tp_size: int,
                 quant_config=None, prefix: str = ""):
        super().__init__()
        h, eps = config.hidden_size, config.rms_norm_eps
        bias = bool(getattr(config, "attention_bias", False))
        self.self_attn = LlamaAttention(config, bias, bias, qk_norm, tp_rank, tp_size, quant_config,
                                        f"{prefix}.self_attn", window, config.query_pre_attn_scalar ** -0.5,
                                        GemmaRMSNorm, getattr(config, "attn_logit_softcapping", None) or 0.0)
        self.mlp = GemmaMLP(config, tp_rank, tp_size, quant_config=quant_config, prefix=f"{prefix}.mlp")
        self.input_layernorm = GemmaRMSNorm(h, eps)
        self.post_attention_layernorm = GemmaRMSNorm(h, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(h, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(h, eps)

    def forward(self, x, residual, cos, sin, kv_cache, meta):
        """(the MLP's normalised output, the residual stream before it), as LlamaDecoderLayer's."""
        x, residual = (self.input_layernorm(x), x) if residual is None else self.input_layernorm(x, residual)
        q, k, v = self.self_attn.project(x)
        out = self.self_attn.attn(q, k, v, kv_cache[0], kv_cache[1], meta, self.self_attn.rope(cos, sin))
        x = self.post_attention_layernorm(self.self_attn.o_proj(out))
        x, residual = self.pre_feedforward_layernorm(x, residual)
        return self.post_feedforward_layernorm(self.mlp(x)), residual


class GemmaModel(nn.Module):
    def __init__(self, config, qk_norm: bool, rope_per_layer_type: bool, tp_rank: int, tp_size: int,
                 quant_config=None, max_model_len: int | None = None):
        """qk_norm, rope_per_layer_type: Gemma 3's (see the module docstring)."""
        super().__init__()
        types = list(getattr(config, "layer_types", None) or ["full_attention"] * config.num_hidden_layers)
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp_rank, tp_size)
        self.embed_scale = math.sqrt(config.hidden_size)
        max_len = max_model_len or config.max_position_embeddings
        windows = sliding_windows(config, max_len)
        self.layers = nn.ModuleList(
            GemmaDecoderLayer(config, windows[i], qk_norm, tp_rank, tp_size, quant_config,
                              f"model.layers.{i}")
            for i in range(config.num_hidden_layers))
        self.norm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rope_of_layer = types if rope_per_layer_type else ["all"] * len(types)
        self.rotary = nn.ModuleDict({kind: RotaryEmbedding(head_dim_of(config), layer_rope(config, kind), 1.0, max_len)
                                     for kind in sorted(set(self.rope_of_layer))})

    def forward(self, input_ids, positions, kv_caches: list[KVCache], meta: AttentionMetadata) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        x = x * float(torch.tensor(self.embed_scale, dtype=x.dtype))  # HF rounds the scale to the dtype first
        rope = {kind: emb(positions, x.dtype) for kind, emb in self.rotary.items()}
        residual = None
        for layer, kind, kv in zip(self.layers, self.rope_of_layer, kv_caches):
            x, residual = layer(x, residual, *rope[kind], kv, meta)
        return self.norm(x) if residual is None else self.norm(x, residual)[0]


def layer_rope(config, layer_type: str) -> dict:
    """The RoPE of a layer type ("all": the one every layer shares): transformers 5 keeps one dict
    per type (rope_parameters), 4.x the global one (rope_theta, rope_scaling) and Gemma 3's local
    base (rope_local_base_freq) beside it."""
    params = getattr(config, "rope_parameters", None)
    if isinstance(params, dict) and per_layer_type(params):
        return rope_parameters(config, layer_type)
    if layer_type == "sliding_attention":
        return {"rope_type": "default", "rope_theta": getattr(config, "rope_local_base_freq", 10000.0)}
    return rope_parameters(config)


class Gemma2ForCausalLM(LlamaForCausalLM):
    """Gemma 2 (see the module docstring): LlamaForCausalLM's loading, fused q/k/v and gate/up,
    and tied head; the Gemma decoder."""
    qk_norm = False
    rope_per_layer_type = False

    def __init__(self, config, tp_rank: int = 0, tp_size: int = 1, quant_config=None,
                 max_model_len: int | None = None):
        nn.Module.__init__(self)
        if getattr(config, "use_bidirectional_attention", False):
            raise ValueError("use_bidirectional_attention is not supported (a causal decoder only)")
        self.config = config
        self.model = GemmaModel(config, self.qk_norm, self.rope_per_layer_type, tp_rank, tp_size, quant_config,
                                max_model_len)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, tp_rank=tp_rank, tp_size=tp_size)
        if getattr(config, "tie_word_embeddings", True):
            self.lm_head.tie(self.model.embed_tokens)
        self.softcap = getattr(config, "final_logit_softcapping", None)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden)
        if self.softcap:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    """Gemma 3's text decoder: Gemma 2's with q/k norms and a RoPE per layer type."""
    qk_norm = True
    rope_per_layer_type = True


class Gemma3TextOfMultimodal(Gemma3ForCausalLM):
    """A Gemma3ForConditionalGeneration checkpoint (gemma-3-4b/12b/27b) served as its text decoder
    (hf_dir.text_decoder_view: the config is its text_config): the decoder's tensors under their
    released names (language_model.model.*) or transformers 5's (model.language_model.*); the
    vision tower and projector are not loaded, so requests are text only."""
    checkpoint_renames = (("language_model.model.", "model."), ("model.language_model.", "model."),
                          ("language_model.lm_head.", "lm_head."))
    checkpoint_skips = ("vision_tower.", "multi_modal_projector.")
