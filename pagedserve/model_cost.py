"""What a model costs per step, from its HF config alone: the weight bytes a decode step reads (the
experts its tokens route to, for a mixture of experts), its matmul and attention FLOPs, its KV bytes
per token. The roofline (benchmark/roofline.py), the simulator (sim.py) and the speculation policy
(a draft's cost over the target's, engine/speculation.py) all price steps with it; it reads no
tensors and imports no torch.
"""
from __future__ import annotations

from dataclasses import dataclass


def experts_touched(num_tokens: int, num_experts: int, top_k: int) -> float:
    """Expected distinct experts of one layer that num_tokens tokens route to, each token picking
    top_k distinct experts uniformly: an expert escapes one token with probability 1 - top_k/E."""
    if num_experts == 0:
        return 0.0
    return num_experts * (1.0 - (1.0 - top_k / num_experts) ** num_tokens)


def moe_shape(cfg) -> tuple[int, int, int, int, int]:
    """(num_experts, top_k, expert intermediate size, shared-expert intermediate size, sparse
    layers) of a mixture-of-experts config; num_experts 0 for a dense model."""
    experts = getattr(cfg, "num_local_experts", None) or getattr(cfg, "num_experts", None) or 0
    if not experts:
        return 0, 0, 0, 0, 0
    top_k = cfg.num_experts_per_tok
    if cfg.model_type == "mixtral":
        return experts, top_k, cfg.intermediate_size, 0, cfg.num_hidden_layers
    step = getattr(cfg, "decoder_sparse_step", 1) or 1
    dense = set(getattr(cfg, "mlp_only_layers", None) or [])
    sparse = sum(1 for i in range(cfg.num_hidden_layers) if i not in dense and (i + 1) % step == 0)
    shared = getattr(cfg, "shared_expert_intermediate_size", 0) or 0
    return experts, top_k, cfg.moe_intermediate_size, shared, sparse


@dataclass
class ModelCost:
    weight_bytes: int          # parameters read once per step (embedding table excluded: it is gathered),
                               # experts of MoE layers excluded (expert_bytes)
    matmul_params: int         # parameters touched per token by matmuls (lm head counted separately);
                               # for MoE the active ones: top_k experts per layer
    lm_head_params: int
    kv_bytes_per_token: int    # all layers, K and V
    attn_flops_per_pair: int   # FLOPs per (query token, context token) pair over all layers
    expert_bytes: int = 0      # one expert of every sparse layer (read if some token routes to it)
    num_experts: int = 0
    top_k: int = 0
    dense_params: int = 0      # the parameters behind weight_bytes, lm head included
    expert_params: int = 0     # the parameters behind expert_bytes
    fp8_matmul_params: int = 0  # the part of matmul_params whose GEMMs run in FP8 (W8A8)

    def step_weight_bytes(self, num_tokens: int) -> float:
        """Weights a step of num_tokens tokens reads: the dense ones, plus the experts its tokens
        touch (expected under uniform routing: the bytes actually read, not the checkpoint's)."""
        return self.weight_bytes + self.expert_bytes * experts_touched(num_tokens, self.num_experts, self.top_k)

    @classmethod
    def from_hf_config(cls, cfg, dtype_bytes: int = 2, fp8_weights: bool = False,
                       kv_dtype_bytes: int | None = None) -> "ModelCost":
        """fp8_weights: the decoder's linear layers and experts hold one byte per weight and multiply
        in FP8 (--quantization fp8 or an FP8 checkpoint); the lm head and MoE routers stay in the
        model dtype, as pagedserve and vLLM keep them. kv_dtype_bytes: 1 for an FP8 KV cache."""
        h = cfg.hidden_size
        layers = cfg.num_hidden_layers
        heads = cfg.num_attention_heads
        head_dim = getattr(cfg, "head_dim", None) or h // heads
        kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
        inter = getattr(cfg, "intermediate_size", None) or getattr(cfg, "ffn_dim")
        gated = cfg.model_type != "opt"
        attn = h * heads * head_dim + 2 * h * kv_heads * head_dim + heads * head_dim * h
        mlp = (3 if gated else 2) * h * inter
        experts, top_k, moe_inter, shared, sparse = moe_shape(cfg)
        expert = 3 * h * moe_inter
        # A sparse layer: router, shared expert and its gate always read; top_k experts per token.
        routers = sparse * (h * experts + (h if shared else 0))
        linear = layers * attn + (layers - sparse) * mlp + sparse * 3 * h * shared  # the quantizable ones
        matmul = linear + routers + sparse * top_k * expert
        lm_head = cfg.vocab_size * h
        wbytes = 1 if fp8_weights else dtype_bytes
        kv_bytes = dtype_bytes if kv_dtype_bytes is None else kv_dtype_bytes
        return cls(weight_bytes=linear * wbytes + (routers + lm_head) * dtype_bytes, matmul_params=matmul,
                   lm_head_params=lm_head, kv_bytes_per_token=layers * 2 * kv_heads * head_dim * kv_bytes,
                   attn_flops_per_pair=layers * 4 * heads * head_dim,
                   expert_bytes=sparse * expert * wbytes, num_experts=experts, top_k=top_k,
                   dense_params=linear + routers + lm_head, expert_params=sparse * expert,
                   fp8_matmul_params=(linear + sparse * top_k * expert) if fp8_weights else 0)

    def attention_cost_context(self) -> int:
        """K: the context length at which one token's attention over it (attn_flops_per_pair per
        earlier token) costs as many FLOPs as its matmuls (2 per parameter touched, lm head aside:
        a prefill samples only its last token)."""
        return max(1, round(2 * self.matmul_params / self.attn_flops_per_pair))

    @classmethod
    def for_engine(cls, engine) -> "ModelCost":
        """The cost of the model an LLMEngine serves, with its weight and KV cache dtypes."""
        from pagedserve.layers.quant.registry import get_quantization_config
        cfg = engine.config
        fp8 = get_quantization_config(cfg.quantization, engine.hf_config) is not None
        return cls.from_hf_config(engine.hf_config, fp8_weights=fp8,
                                  kv_dtype_bytes=1 if cfg.kv_cache_dtype != "auto" else None)

    @property
    def total_params(self) -> int:
        """Matmul parameters of the checkpoint (every expert), lm head included."""
        return self.dense_params + self.expert_params * self.num_experts

    @property
    def active_params(self) -> int:
        """Parameters one token's forward multiplies by (top_k experts per layer), lm head included."""
        return self.matmul_params + self.lm_head_params

    def step_matmul_seconds(self, num_tokens: int, num_sampled: int, flops_rate: float,
                            fp8_flops_rate: float | None = None) -> float:
        """Compute time of one step's matmuls: FP8 GEMMs at fp8_flops_rate (the H200's is twice
        its bf16 rate), the rest (lm head over the sampled rows, routers) at flops_rate."""
        fp8 = 2 * self.fp8_matmul_params * num_tokens
        other = 2 * (self.matmul_params - self.fp8_matmul_params) * num_tokens + 2 * self.lm_head_params * num_sampled
        return other / flops_rate + fp8 / (fp8_flops_rate or flops_rate)

    def step_flops_seconds(self, num_tokens: int, num_sampled: int, attended_pairs: int,
                           flops_rate: float, fp8_flops_rate: float | None = None) -> float:
        """Compute time of one step: its matmuls, and attention at flops_rate."""
        return (self.step_matmul_seconds(num_tokens, num_sampled, flops_rate, fp8_flops_rate)
                + self.attn_flops_per_pair * attended_pairs / flops_rate)
