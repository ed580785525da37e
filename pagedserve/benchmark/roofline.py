"""The time a perfect engine would need for the schedule actually executed (docs/benchmarks.md).

Per step: max(bytes moved / copy bandwidth, FLOPs / matmul rate), where bytes are the
weights once plus the KV bytes of every context token attended to, summed over steps.
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class ModelCost:
    weight_bytes: int          # parameters read once per step (embedding table excluded: it is gathered)
    matmul_params: int         # parameters touched per token by matmuls (lm head counted separately)
    lm_head_params: int
    kv_bytes_per_token: int    # all layers, K and V
    attn_flops_per_pair: int   # FLOPs per (query token, context token) pair over all layers

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
        matmul = layers * (attn + mlp)
        lm_head = cfg.vocab_size * h
        return cls(weight_bytes=(matmul + lm_head) * dtype_bytes, matmul_params=matmul,
                   lm_head_params=lm_head, kv_bytes_per_token=layers * 2 * kv_heads * head_dim * dtype_bytes,
                   attn_flops_per_pair=layers * 4 * heads * head_dim)


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
            nbytes = cost.weight_bytes + st.context_tokens * cost.kv_bytes_per_token
            flops = (2 * cost.matmul_params * st.num_tokens + 2 * cost.lm_head_params * st.num_sampled
                     + cost.attn_flops_per_pair * st.attended_pairs)
            total += max(nbytes / bandwidth, flops / flops_rate)
        return total
