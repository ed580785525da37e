"""The adaptive policy: how many tokens to propose this step, from the batch's size and from what
speculation has been yielding.

Batch size. Verification is free only while a decode step is bound by reading the weights. A
step of d running decodes each verifying k proposals computes d x (1 + k) tokens; once that is
large the step becomes compute-bound and every rejected token costs real time (vLLM users see
n-gram speculation slow serving down under load). So k shrinks as the batch grows:
    k = min(num_speculative_tokens, spec_disable_batch_tokens // d - 1)
and speculation is off for the step when that is below 1. The default threshold, 256 batched
tokens (speculative_config.spec_disable_batch_tokens), keeps k = 4 up to 51 decodes, k = 1 up
to 128 and turns speculation off beyond: a Llama-8B decode step on an H200 stays weight-bound
to a few hundred tokens. vLLM's disable_by_batch_size also turns speculation off once that many
requests run. A step without speculation keeps the engine's overlapped scheduling.

Yield. A speculating step is synchronous (the proposer needs the previous step's tokens on the
host) and pays the proposer and the verification of every proposal; a plain step overlaps the
next step's scheduling with the device. Speculation pays only while its steps emit clearly more
than one token per row. A step's yield is the tokens its speculating rows emitted per row:
1 + accepted proposals / rows that got proposals. Rows the proposer had nothing for are left
out, and a step where no row got one is not observed: such rows cost no verification, and an
n-gram proposer that has not matched yet (a model starts repeating itself only after a while)
must not pause speculation before it has proposed anything (that cost the demo model's plain
prompts most of n-gram's speed-up when those rows counted 1). The policy keeps an exponentially weighted estimate of it (weight
YIELD_WEIGHT for the newest step; it starts at 1 + num_speculative_tokens, what a fully
accepted step yields: speculation is presumed to pay until steps show otherwise). When the
estimate falls below min_speculation_yield, speculation pauses: k = 0 for the next
first_pause_steps steps (overlapped), then one speculating step probes. A probe whose own yield
reaches the threshold resumes speculation (the estimate restarts from it, the pause length
from first_pause_steps); one that does not pauses again for twice as long, up to
max_pause_steps. A paused step is one the batch rule would have speculated in; only those count
down a pause. The decision is a function of the observed yields alone (no clock, no
randomness), so a run's schedule is exact and reproducible.

Nothing proposed. A speculating step in which no row got a proposal (an n-gram proposer over
text that does not repeat) has no yield, yet it still ran synchronously: an n-gram that never
matches would make every step ~1.25x an overlapped one (what vLLM users report). So, with pausing
on (min_speculation_yield above 1), EMPTY_STEPS_BEFORE_PAUSE such steps in a row pause
speculation too: first_pause_steps steps, then one probe; a probe that proposes nothing again
doubles the pause, up to MAX_EMPTY_PAUSE_STEPS (shorter than a low yield's cap: text that starts
repeating later is found within that many steps); a step with proposals ends the streak and
resets this backoff. In the steady state of a proposer that never matches, one step in
1 + MAX_EMPTY_PAUSE_STEPS is synchronous. The streak is long (16) because a model's own
repetition, the n-gram's food, often begins only some tokens in (the test model's within 15).
"""
from __future__ import annotations

# Weight of the newest step's yield in the estimate: about the last 7 steps matter (the
# estimate's variance is w / (2 - w) of a step's), so one unlucky step does not pause.
YIELD_WEIGHT = 0.25
FIRST_PAUSE_STEPS = 8
MAX_PAUSE_STEPS = 256
EMPTY_STEPS_BEFORE_PAUSE = 16
MAX_EMPTY_PAUSE_STEPS = 32


class SpeculationPolicy:
    def __init__(self, num_speculative_tokens: int, disable_batch_tokens: int,
                 disable_by_batch_size: int | None = None, min_speculation_yield: float = 0.0,
                 first_pause_steps: int = FIRST_PAUSE_STEPS, max_pause_steps: int = MAX_PAUSE_STEPS) -> None:
        """min_speculation_yield <= 1.0 never pauses (a step yields at least 1 per row)."""
        self.k = num_speculative_tokens
        self.disable_batch_tokens = disable_batch_tokens
        self.disable_by_batch_size = disable_by_batch_size
        self.min_yield = min_speculation_yield
        self.first_pause, self.max_pause = first_pause_steps, max_pause_steps
        self.num_paused_steps = 0  # since start: steps the pause kept from speculating
        self.reset()

    def reset(self) -> None:
        """Forget what speculation yielded (the engine calls it when it runs out of requests, so
        that each offline batch starts alike); the paused-step count stays."""
        self.estimate = 1.0 + self.k
        self.pause_left = 0            # steps still paused
        self.next_pause = self.first_pause
        self.probing = False           # the next observed step is a probe
        self.empty_streak = 0          # speculating steps in a row in which no row got a proposal
        self.next_empty_pause = self.first_pause

    def tokens_to_propose(self, num_decodes: int) -> int:
        """k for this step given the running decodes (0: do not speculate)."""
        if num_decodes <= 0:
            return 0
        if self.disable_by_batch_size is not None and num_decodes >= self.disable_by_batch_size:
            return 0
        k = max(0, min(self.k, self.disable_batch_tokens // num_decodes - 1))
        if k and self.pause_left:
            self.pause_left -= 1
            self.num_paused_steps += 1
            return 0
        return k

    def observe(self, step_yield: float) -> None:
        """A speculating step's yield (see the module docstring); steps where no row got a
        proposal go to observe_empty instead."""
        self.empty_streak = 0
        self.next_empty_pause = self.first_pause
        if self.probing:
            if step_yield >= self.min_yield:
                self.probing = False
                self.estimate = step_yield
                self.next_pause = self.first_pause
            else:
                self._pause()
            return
        self.estimate += YIELD_WEIGHT * (step_yield - self.estimate)
        if self.estimate < self.min_yield:
            self._pause()

    def observe_empty(self) -> None:
        """A speculating step in which no row got a proposal (see the module docstring)."""
        if self.min_yield <= 1.0:
            return
        self.empty_streak += 1
        if self.empty_streak >= EMPTY_STEPS_BEFORE_PAUSE:
            self.pause_left = self.next_empty_pause
            self.next_empty_pause = min(2 * self.next_empty_pause, MAX_EMPTY_PAUSE_STEPS)

    def _pause(self) -> None:
        self.pause_left = self.next_pause
        self.next_pause = min(2 * self.next_pause, self.max_pause)
        self.probing = True
