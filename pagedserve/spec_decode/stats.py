"""Speculative decoding's counters since start, vLLM's spec_decode_* names (pagedserve:* in /metrics).

acceptance rate = num_accepted_tokens / num_draft_tokens; mean accepted length (tokens a
verifying row emits) = 1 + num_accepted_tokens / num_drafts.
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpecDecodeStats:
    num_drafts: int = 0                 # rows that verified at least one proposed token
    num_draft_tokens: int = 0           # proposed tokens verified
    num_accepted_tokens: int = 0        # of those, accepted
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)  # [j]: accepted at position j
    proposer_seconds: float = 0.0       # host time spent proposing
    num_spec_steps: int = 0             # steps that verified proposals
    num_paused_steps: int = 0           # steps the policy kept from speculating for a low yield
    num_unproposed_steps: int = 0       # steps due to speculate that a host-side proposer had
                                        # nothing for before they gave up their overlap
    num_shadow_probes: int = 0          # probes taken over host histories and scored from the
                                        # tokens decoding emitted (spec_decode/shadow.py)

    def record(self, num_draft: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_draft
        self.num_accepted_tokens += num_accepted
        per = self.num_accepted_tokens_per_pos
        if len(per) < num_draft:
            per.extend([0] * (num_draft - len(per)))
        for j in range(num_accepted):
            per[j] += 1

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0
