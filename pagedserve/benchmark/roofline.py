"""The time a perfect engine would need for the schedule actually executed (docs/benchmarks.md).

Per step: max(bytes moved / copy bandwidth, FLOPs / matmul rate), where bytes are the
weights once plus the KV bytes of every context token attended to, summed over steps. For a
mixture of experts the weights are those the step reads: the dense ones plus the experts its
tokens route to (expected under uniform routing), and the FLOPs count top_k experts per token.
"""
from __future__ import annotations

from dataclasses import dataclass, field


# The cost model lives beside the engine (the policy and sim use it too); re-exported for the roofline's users.
from pagedserve.model_cost import ModelCost, experts_touched, moe_shape  # noqa: E402,F401


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

    def ideal_seconds(self, cost: ModelCost, bandwidth: float, flops_rate: float,
                      fp8_flops_rate: float | None = None) -> float:
        """Per step, max(every byte it moves / bandwidth, every FLOP / rate): a perfect engine that
        overlaps the memory-bound work (attention's KV reads) with the compute-bound (GEMMs)."""
        total = 0.0
        for st in self.steps:
            nbytes = cost.step_weight_bytes(st.num_tokens) + st.context_tokens * cost.kv_bytes_per_token
            compute = cost.step_flops_seconds(st.num_tokens, st.num_sampled, st.attended_pairs, flops_rate,
                                              fp8_flops_rate)
            total += max(nbytes / bandwidth, compute)
        return total

    def serial_ideal_seconds(self, cost: ModelCost, bandwidth: float, flops_rate: float,
                             fp8_flops_rate: float | None = None) -> float:
        """Per step, the matmuls at their own bound (weights read or FLOPs) plus attention at its
        own (KV read or FLOPs), one after the other: a perfect engine that runs each layer's GEMMs
        and attention in sequence, as pagedserve and vLLM do. At large decode batches the GEMMs
        are compute-bound and attention memory-bound, and this is well above ideal_seconds: only
        overlapping the two (two nano-batches on two streams) gets below it."""
        total = 0.0
        for st in self.steps:
            matmul = max(cost.step_weight_bytes(st.num_tokens) / bandwidth,
                         cost.step_matmul_seconds(st.num_tokens, st.num_sampled, flops_rate, fp8_flops_rate))
            attention = max(st.context_tokens * cost.kv_bytes_per_token / bandwidth,
                            cost.attn_flops_per_pair * st.attended_pairs / flops_rate)
            total += matmul + attention
        return total
