"""The time a perfect engine would need for the schedule actually executed (docs/benchmarks.md).

Per step: max(bytes moved / copy bandwidth, FLOPs / matmul rate), where bytes are the
weights once plus the KV bytes of every context token attended to, summed over steps. For a
mixture of experts the weights are those the step reads: the dense ones plus the experts its
tokens route to (expected under uniform routing), and the FLOPs count top_k experts per token.
"""
from __future__ import annotations

from dataclasses import dataclass, field


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
    dtype_bytes: int = 2

    def step_weight_bytes(self, num_tokens: int) -> float:
        """Weights a step of num_tokens tokens reads: the dense ones, plus the experts its tokens
        touch (expected under uniform routing: the bytes actually read, not the checkpoint's)."""
        return self.weight_bytes + self.expert_bytes * experts_touched(num_tokens, self.num_experts, self.top_k)

    @classmethod
    def from_hf_config(cls, cfg, dtype_bytes: int = 2) -> "ModelCost":
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
        sparse_always = h * experts + (3 * h * shared + h if shared else 0)
        dense_weights = layers * attn + (layers - sparse) * mlp + sparse * sparse_always
        matmul = dense_weights + sparse * top_k * expert
        lm_head = cfg.vocab_size * h
        return cls(weight_bytes=(dense_weights + lm_head) * dtype_bytes, matmul_params=matmul,
                   lm_head_params=lm_head, kv_bytes_per_token=layers * 2 * kv_heads * head_dim * dtype_bytes,
                   attn_flops_per_pair=layers * 4 * heads * head_dim,
                   expert_bytes=sparse * expert * dtype_bytes, num_experts=experts, top_k=top_k,
                   dtype_bytes=dtype_bytes)

    @property
    def total_params(self) -> int:
        """Matmul parameters of the checkpoint (every expert), lm head included."""
        return (self.weight_bytes + self.expert_bytes * self.num_experts) // self.dtype_bytes

    @property
    def active_params(self) -> int:
        """Parameters one token's forward multiplies by (top_k experts per layer), lm head included."""
        return self.matmul_params + self.lm_head_params


@dataclass
class StepRecord:
    num_tokens: int
    num_sampled: int
    context_tokens: int        # sum of seq_lens: KV tokens read
    attended_pairs: int        # sum over query tokens of the context each attends to


@dataclass
class StepLog:
    steps: list[StepRecord] = field(default_factory=list)

    def record(self, out) -> None:
        """Summarise one SchedulerOutput (core/plan.py)."""
        tokens = sampled = ctx = pairs = 0
        for s in out.scheduled:
            q, L = s.num_new_tokens, s.context_len
            tokens += q
            sampled += s.do_sample
            ctx += L
            pairs += q * L - q * (q - 1) // 2
        if tokens:
            self.steps.append(StepRecord(tokens, sampled, ctx, pairs))

    def ideal_seconds(self, cost: ModelCost, bandwidth: float, flops_rate: float) -> float:
        total = 0.0
        for st in self.steps:
            nbytes = cost.step_weight_bytes(st.num_tokens) + st.context_tokens * cost.kv_bytes_per_token
            flops = (2 * cost.matmul_params * st.num_tokens + 2 * cost.lm_head_params * st.num_sampled
                     + cost.attn_flops_per_pair * st.attended_pairs)
            total += max(nbytes / bandwidth, flops / flops_rate)
        return total
