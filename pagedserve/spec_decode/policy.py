"""The adaptive policy: how many tokens to propose this step, from the batch's size.

Why: verification is free only while a decode step is bound by reading the weights. A step of
d running decodes each verifying k proposals computes d x (1 + k) tokens; once that is large the
step becomes compute-bound and every rejected token costs real time (vLLM users see n-gram
speculation slow serving down under load). So k shrinks as the batch grows:
    k = min(num_speculative_tokens, spec_disable_batch_tokens // d - 1)
and speculation is off for the step when that is below 1. The default threshold, 256 batched
tokens (speculative_config.spec_disable_batch_tokens), keeps k = 4 up to 51 decodes, k = 1 up
to 128 and turns speculation off beyond: a Llama-8B decode step on an H200 stays weight-bound
to a few hundred tokens. vLLM's disable_by_batch_size also turns speculation off once that many
requests run. A step without speculation keeps the engine's overlapped scheduling.
"""
from __future__ import annotations


class SpeculationPolicy:
    def __init__(self, num_speculative_tokens: int, disable_batch_tokens: int,
                 disable_by_batch_size: int | None = None) -> None:
        self.k = num_speculative_tokens
        self.disable_batch_tokens = disable_batch_tokens
        self.disable_by_batch_size = disable_by_batch_size

    def tokens_to_propose(self, num_decodes: int) -> int:
        """k for this step given the running decodes (0: do not speculate)."""
        if num_decodes <= 0:
            return 0
        if self.disable_by_batch_size is not None and num_decodes >= self.disable_by_batch_size:
            return 0
        return max(0, min(self.k, self.disable_batch_tokens // num_decodes - 1))
