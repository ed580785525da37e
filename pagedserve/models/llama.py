"""Llama-family decoders: Llama (incl. llama3 rope scaling), Mistral (sliding window), Qwen2 (qkv bias,
sliding-window layers where configured), Qwen3 (q/k RMSNorm), Phi-3 (q/k/v and gate/up fused in the
checkpoint, LongRoPE, Phi-3-mini-4k's sliding window), Granite (four multipliers), SmolLM3 (NoPE
layers), Ministral (Mistral's block, sliding-window layers by config.layer_types).

Pre-norm blocks: x += attn(norm(x)); x += mlp(norm(x)), SwiGLU MLP, rotary on q and k.
The residual stream is carried beside the hidden state (x, residual = norm(x, residual)) so that
each add lands inside the next norm: one kernel on CUDA (layers/fused.py), the same arithmetic
in torch. With FP8 linears, the op before each (the two norms, SiLU-and-mul) also quantizes its
output for it (set once at load time: layers/quant/fusion.py). Module and parameter names follow the HF checkpoints, except that q/k/v and gate/up
are fused (see stacked_params).
"""
from __future__ import annotations

import torch
from torch import nn

from pagedserve.attention import Attention, AttentionMetadata
from pagedserve.layers.activation import silu_and_mul
from pagedserve.layers.linear import (MergedColumnParallelLinear, ParallelLMHead, QKVParallelLinear,
                                      RowParallelLinear, VocabParallelEmbedding)
from pagedserve.layers.norm import RMSNorm
from pagedserve.layers.quant.fusion import takes_fp8_activation
from pagedserve.layers.rotary import Rope, RotaryEmbedding
from pagedserve.models.hf_dir import rope_parameters, sliding_windows

KVCache = tuple[torch.Tensor, torch.Tensor]


def head_dim_of(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


class LlamaAttention(nn.Module):
    """The block's projections and attention; LlamaDecoderLayer calls them in order (project,
    attn with rope, o_proj), so that models/nano_batches.py can put the attention on a stream of
    its own. The rotary (after Qwen3's q/k norms) is applied by the attention where it writes
    K/V, in the same kernel on CUDA (Attention.rotate_and_store)."""

    def __init__(self, config, qkv_bias: bool, o_bias: bool, qk_norm: bool, tp_rank: int, tp_size: int,
                 quant_config=None, prefix: str = "", sliding_window: int = 0, scale: float | None = None,
                 norm_cls: type[nn.Module] = RMSNorm, logit_softcap: float = 0.0):
        """scale: the attention's (None: head_dim ** -0.5); norm_cls: the q/k norms' class;
        sliding_window, logit_softcap: the Attention's."""
        super().__init__()
        self.head_dim = head_dim_of(config)
        num_kv = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        self.qkv_proj = QKVParallelLinear(config.hidden_size, self.head_dim, config.num_attention_heads, num_kv,
                                          qkv_bias, tp_rank, tp_size, quant_config, f"{prefix}.qkv_proj")
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.o_proj = RowParallelLinear(config.num_attention_heads * self.head_dim, config.hidden_size, o_bias,
                                        tp_rank, tp_size, quant_config=quant_config, prefix=f"{prefix}.o_proj")
        if qk_norm:
            self.q_norm = norm_cls(self.head_dim, config.rms_norm_eps)
            self.k_norm = norm_cls(self.head_dim, config.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None
        self.use_rope = True  # LlamaModel turns it off for config.no_rope_layers' NoPE layers
        # The global KV heads this rank holds, so a checkpoint's per-head KV scales shard as k/v_proj do.
        self.attn = Attention(self.num_heads, self.num_kv_heads, self.head_dim,
                              self.head_dim ** -0.5 if scale is None else scale,
                              total_num_kv_heads=num_kv, kv_head_start=self.qkv_proj.kv_head_start,
                              sliding_window=sliding_window, logit_softcap=logit_softcap)

    def project(self, x: torch.Tensor):
        """(q, k, v) of x, not yet rotated: [T, heads, head_dim] each but v ([T, kv heads * head_dim]),
        views of one projection output (the rotary works in place on them)."""
        qkv = self.qkv_proj(x)  # x: [T, hidden], or the same quantized (an Fp8Activation)
        T = qkv.shape[0]
        q, k, v = self.qkv_proj.split(qkv)
        return q.view(T, self.num_heads, self.head_dim), k.view(T, self.num_kv_heads, self.head_dim), v

    def rope(self, cos: torch.Tensor, sin: torch.Tensor) -> Rope | None:
        """This layer's rotary at the step's positions (cos/sin), for attn; None in a NoPE layer
        (use_rope False: SmolLM3's every fourth), whose q and k are not rotated."""
        if not self.use_rope:
            return None
        return Rope(cos, sin, self.q_norm, self.k_norm)


def check_silu(config) -> None:
    act = getattr(config, "hidden_act", "silu")
    if act not in ("silu", "swish"):
        raise ValueError(f"hidden_act {act!r} is not supported (only silu)")


class LlamaMLP(nn.Module):
    def __init__(self, config, tp_rank: int, tp_size: int, intermediate_size: int | None = None,
                 reduce_results: bool = True, quant_config=None, prefix: str = ""):
        """intermediate_size: config.intermediate_size unless given (MoE models' shared expert);
        reduce_results=False leaves the all-reduce of the down projection to the caller."""
        super().__init__()
        self.check_activation(config)
        bias = bool(getattr(config, "mlp_bias", False))
        inter = intermediate_size or config.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(config.hidden_size, [inter] * 2, bias, tp_rank, tp_size,
                                                       quant_config, f"{prefix}.gate_up_proj",
                                                       checkpoint_parts=("gate_proj", "up_proj"))
        self.down_proj = RowParallelLinear(inter, config.hidden_size, bias, tp_rank, tp_size,
                                           reduce_results=reduce_results, quant_config=quant_config,
                                           prefix=f"{prefix}.down_proj")
        self.fp8_act = False  # SiLU-and-mul quantizes for down_proj (LlamaDecoderLayer.set_fp8_activation_fusion)

    @staticmethod
    def check_activation(config) -> None:
        check_silu(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_and_mul(self.gate_up_proj(x), fp8_out=self.fp8_act))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config, qkv_bias: bool, o_bias: bool, qk_norm: bool, tp_rank: int, tp_size: int,
                 quant_config=None, prefix: str = "", mlp: nn.Module | None = None, sliding_window: int = 0):
        """mlp: the block's MLP (any module mapping [T, hidden] to [T, hidden], e.g. a mixture of
        experts); a dense LlamaMLP when None. sliding_window: the attention's (0: none)."""
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = LlamaAttention(config, qkv_bias, o_bias, qk_norm, tp_rank, tp_size, quant_config,
                                        f"{prefix}.self_attn", sliding_window,
                                        getattr(config, "attention_multiplier", None))
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = mlp if mlp is not None else LlamaMLP(config, tp_rank, tp_size, quant_config=quant_config,
                                                        prefix=f"{prefix}.mlp")
        # Granite's: the attention's and the MLP's outputs are scaled before they join the residual stream.
        self.residual_multiplier = float(getattr(config, "residual_multiplier", 1.0))

    def set_fp8_activation_fusion(self, enabled: bool) -> int:
        """Once, at load time: each op before an FP8 linear that takes quantized activations
        returns its output quantized (layers/quant/fusion.py). Returns how many ops do."""
        self.input_layernorm.fp8_out = enabled and takes_fp8_activation(self.self_attn.qkv_proj)
        fused = [self.input_layernorm.fp8_out]
        if isinstance(self.mlp, LlamaMLP):  # a mixture of experts reads the norm's output in its own dtype
            self.post_attention_layernorm.fp8_out = enabled and takes_fp8_activation(self.mlp.gate_up_proj)
            self.mlp.fp8_act = enabled and takes_fp8_activation(self.mlp.down_proj)
            fused += [self.post_attention_layernorm.fp8_out, self.mlp.fp8_act]
        return sum(fused)

    def forward(self, x, residual, cos, sin, kv_cache, meta):
        """Returns (mlp output, residual stream before it); the caller's next norm adds them."""
        q, k, v, residual = self.before_attention(x, residual)
        out = self.self_attn.attn(q, k, v, kv_cache[0], kv_cache[1], meta, self.self_attn.rope(cos, sin))
        return self.after_attention(out, residual)

    # forward in two halves around the attention itself: models/nano_batches.py runs one
    # nano-batch's attention on a second stream beside the other nano-batch's matmuls.
    def before_attention(self, x, residual):
        """(q, k, v, residual): the input norm (adding the residual stream) and the projections
        (q and k not yet rotated: the attention applies self_attn.rope)."""
        x, residual = (self.input_layernorm(x), x) if residual is None else self.input_layernorm(x, residual)
        return *self.self_attn.project(x), residual

    def after_attention(self, attn_out, residual):
        """(mlp output, residual) from the attention's output [T, heads * head_dim]: o_proj, the
        post-attention norm (adding the residual stream) and the MLP."""
        out = self.self_attn.o_proj(attn_out)
        if self.residual_multiplier != 1.0:
            out = out * self.residual_multiplier
        x, residual = self.post_attention_layernorm(out, residual)
        x = self.mlp(x)
        return (x if self.residual_multiplier == 1.0 else x * self.residual_multiplier), residual


class LlamaModel(nn.Module):
    def __init__(self, config, qkv_bias: bool, o_bias: bool, qk_norm: bool, tp_rank: int, tp_size: int,
                 quant_config=None, make_mlp=None, max_model_len: int | None = None):
        """make_mlp(layer_index) -> the layer's MLP module (None: dense LlamaMLP); max_model_len: the
        engine's (None: the config's max_position_embeddings), which picks LongRoPE's factors and
        which layers' sliding windows can bind (hf_dir.sliding_windows)."""
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp_rank, tp_size)
        windows = sliding_windows(config, max_model_len or config.max_position_embeddings)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, qkv_bias, o_bias, qk_norm, tp_rank, tp_size, quant_config,
                              f"model.layers.{i}", make_mlp and make_mlp(i), windows[i])
            for i in range(config.num_hidden_layers))
        # SmolLM3's NoPE layers: no_rope_layers[i] is 0 where layer i rotates nothing (1: RoPE).
        for layer, use in zip(self.layers, getattr(config, "no_rope_layers", None) or []):
            if not use and layer.self_attn.q_norm is not None:
                raise ValueError("no_rope_layers with q/k norms is not supported")
            layer.self_attn.use_rope = bool(use)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        rope = rope_parameters(config)  # transformers 5 keeps partial_rotary_factor there, 4 beside it
        partial = getattr(config, "partial_rotary_factor", None) or rope.get("partial_rotary_factor") or 1.0
        self.rotary_emb = RotaryEmbedding(head_dim_of(config), rope, partial,
                                          max_model_len or config.max_position_embeddings)
        self.embedding_multiplier = float(getattr(config, "embedding_multiplier", 1.0))  # Granite's

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        return x if self.embedding_multiplier == 1.0 else x * self.embedding_multiplier

    def forward(self, input_ids, positions, kv_caches: list[KVCache], meta: AttentionMetadata) -> torch.Tensor:
        x = self.embed(input_ids)
        cos, sin = self.rotary_emb(positions, x.dtype)
        residual = None
        for layer, kv in zip(self.layers, kv_caches):
            x, residual = layer(x, residual, cos, sin, kv, meta)
        return self.norm(x) if residual is None else self.norm(x, residual)[0]


class LlamaForCausalLM(nn.Module):
    # (fused parameter, checkpoint name, shard id)
    stacked_params = [("qkv_proj", "q_proj", "q"), ("qkv_proj", "k_proj", "k"), ("qkv_proj", "v_proj", "v"),
                      ("gate_up_proj", "gate_proj", 0), ("gate_up_proj", "up_proj", 1)]
    qkv_bias: bool | None = None  # None: from config.attention_bias
    qk_norm = False

    def __init__(self, config, tp_rank: int = 0, tp_size: int = 1, quant_config=None,
                 max_model_len: int | None = None):
        super().__init__()
        self.config = config
        attn_bias = bool(getattr(config, "attention_bias", False))
        qkv_bias = attn_bias if self.qkv_bias is None else self.qkv_bias
        self.model = LlamaModel(config, qkv_bias, attn_bias, self.qk_norm, tp_rank, tp_size, quant_config,
                                lambda i: self.make_mlp(config, i, tp_rank, tp_size), max_model_len)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, tp_rank=tp_rank, tp_size=tp_size)
        if getattr(config, "tie_word_embeddings", False):
            self.lm_head.tie(self.model.embed_tokens)

    def make_mlp(self, config, layer_index: int, tp_rank: int, tp_size: int) -> nn.Module | None:
        """The MLP of layer `layer_index`; None: the dense LlamaMLP (MoE families override this)."""
        return None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[KVCache],
                attn_meta: AttentionMetadata) -> torch.Tensor:
        return self.model(input_ids, positions, kv_caches, attn_meta)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden)
        scaling = getattr(self.config, "logits_scaling", 1.0)  # Granite's
        return logits if scaling == 1.0 else logits / scaling


class MistralForCausalLM(LlamaForCausalLM):
    pass


class SmolLM3ForCausalLM(LlamaForCausalLM):
    """SmolLM3: Llama's block, every fourth layer without RoPE (config.no_rope_layers, LlamaModel)."""


class GraniteForCausalLM(LlamaForCausalLM):
    """IBM Granite 3.x: Llama's block with four multipliers (config fields only Granite's configs
    have): the embeddings' (embedding_multiplier), the attention's scale (attention_multiplier),
    the attention's and MLP's outputs before the residual add (residual_multiplier), and the
    logits divided by logits_scaling."""


class Qwen2ForCausalLM(LlamaForCausalLM):
    qkv_bias = True


class Qwen3ForCausalLM(LlamaForCausalLM):
    qk_norm = True


class Phi3ForCausalLM(LlamaForCausalLM):
    """Phi-3, Phi-3.5-mini, Phi-4-mini: Llama's block. The checkpoint holds q/k/v and gate/up already
    fused; the loader cuts each into the parts our fused linears load by name
    (checkpoint_row_splits), so a tensor-parallel rank still reads only its own rows. Their long
    contexts come from LongRoPE (layers/rotary.py)."""

    def checkpoint_row_splits(self) -> dict[str, list[tuple[str, int]]]:
        """fused checkpoint module -> its parts, in row order: (the name stacked_params knows, rows)."""
        c = self.config
        head_dim = head_dim_of(c)
        q, kv = c.num_attention_heads * head_dim, (c.num_key_value_heads or c.num_attention_heads) * head_dim
        inter = c.intermediate_size
        return {"qkv_proj": [("q_proj", q), ("k_proj", kv), ("v_proj", kv)],
                "gate_up_proj": [("gate_proj", inter), ("up_proj", inter)]}
