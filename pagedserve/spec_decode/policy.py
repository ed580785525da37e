"""The adaptive policy: how many tokens to propose this step, from the batch's size, from what a
proposal costs and from what speculation has been yielding.

Batch size. Verification is free only while a decode step is bound by reading the weights, and a
speculating step is synchronous. A step of d running decodes each verifying k proposals computes
d x (1 + k) tokens; once that is large every rejected token costs real time, and the host work
that an overlapped step hides grows with d (vLLM users see n-gram speculation slow serving down
under load). So k shrinks as the batch grows:
    k = min(num_speculative_tokens, spec_disable_batch_tokens // d - 1)
and speculation is off for the step when that is below 1. The default threshold, 128 batched
tokens (speculative_config.spec_disable_batch_tokens), keeps k = 4 up to 25 decodes, k = 1 up to
64 and turns speculation off beyond. On the H200 (Llama-3.1-8B, docs/speculative-decoding.md) a
synchronous step cost 1.21x / 1.25x an overlapped one at 1 / 8 decodes and 1.31x / 1.41x at 32 /
128, so at 128 decodes even a k = 1 step whose proposal is always accepted gains nothing.
vLLM's disable_by_batch_size also turns speculation off once that many requests run. A step
without speculation keeps the engine's overlapped scheduling.

Cost. A proposal is not free when a draft model makes it: each proposed token is one draft
forward, about draft / target weight bytes of a target step (proposer_cost; 0 for n-gram). A step
of k proposals then costs about 1 + k x proposer_cost target steps, so it must yield
    threshold(k) = min_speculation_yield x (1 + k x proposer_cost)
tokens per row to pay. Where even a fully accepted step (1 + k tokens) cannot reach it (a draft as
large as the target), the policy does not speculate at all (cannot_pay).

Yield. A step's yield is the tokens its speculating rows emitted per row: 1 + accepted proposals
/ rows that got proposals, and its gain that yield over threshold(k) of its k (gain 1: the step
paid for itself exactly). Rows the proposer had nothing for are left out, and a step where no row
got one is not observed: such rows cost no verification, and an n-gram proposer that has not
matched yet must not pause speculation before it has proposed anything.
The first speculating step after a (re)start (the engine starting, or running out of requests:
reset; or a pause for nothing proposed, below) is a probe: it proposes the fewest tokens that can
pay (probe_k: 1 for n-gram), so a proposer whose every proposal is rejected costs one cheap step
before its first pause, not a full-k one (a first k = 4 step at 32 decodes verifies 160
tokens; the H200's always-rejected replay measured TPOT 1.018 / 1.026 / 1.062x speculation off
at 1 / 8 / 32 decodes with one); a probe whose own gain reaches 1 resumes speculation at full k,
the estimate starting from its gain. The policy keeps an estimate of the gain: the mean of the steps so far while there
are few of them (so one step's evidence decides at once), then an exponentially weighted one
(weight YIELD_WEIGHT for the newest step: about the last 7 steps matter). When the estimate falls
below 1, speculation pauses: k = 0 for the next first_pause_steps steps (overlapped), then one
speculating step probes; a failed probe costs little more than a synchronous step. A probe that
pays resumes speculation at full k (the estimate restarts from it, the pause length from
first_pause_steps); one that does not pauses again for twice as long, up to max_pause_steps. A
paused step is one the batch rule would have speculated in; only those count down a pause. The
decision is a function of the observed yields alone (no clock, no randomness), so a run's schedule
is exact and reproducible.

Shadow probes. A host-side proposer's probe (spec_decode/proposer.py peek_proposals: n-gram)
needs neither the device nor a synchronous step: the engine has it propose over the history a
verified probe would have seen (the host's, once the token in flight has arrived) and scores the
proposals against the tokens decoding emits next (spec_decode/shadow.py; exact in distribution for
a one-hot proposer, equal for greedy). On the H200 at e6c6628 an always-rejected replay's
verified probes (5, 5 and 3 in 128 steps) still cost 1.023 / 1.033 / 1.029x speculation off at
1 / 8 / 32 decodes. The policy withholds speculation while a shadow probe is scored
(begin_shadow; the steps count as paused), then
decides on its yield as on a verified probe's (observe_shadow), over the k the batch rule allows
rather than probe_k's (a shadow proposal costs nothing on the device). So a paused n-gram whose
text never repeats, or whose every proposal is rejected, runs no synchronous step at all; only a
proposer that cannot propose on the host (a draft model) still probes by verifying. Nor does a
failed shadow probe back off: the next one comes after first_pause_steps again, so text that
starts repeating late in a long generation is found within about ten steps, not after up to
max_pause_steps.

Nothing to propose. A speculating step in which no row got a proposal has no yield, yet once it
has given up its overlap it costs what a speculating step does (an n-gram that never matches would
make every step ~1.25x an overlapped one: what vLLM users report). The engine avoids most such
steps (LLMEngine.step): a host-side proposer (proposes_on_host, spec_decode/proposer.py: n-gram)
is asked before the step gives up its overlap, over the histories the host has (one token stale
while a step is in flight), and with nothing there the step stays overlapped and the policy hears
nothing_to_propose: the step is neither paused nor empty (it cost nothing), and a due probe stays
due. On the H200 (Llama-3.1-8B, 128 output tokens, before the peek) an n-gram that never matched
ran about 12 of its 127 decode steps synchronously under the streak rule below (TPOT 1.015 /
1.033 / 1.044x speculation off at 1 / 8 / 32 decodes; a proposer with nothing at all 1.020 /
1.030 / 1.035x), each 1.21 / 1.25 / 1.31x an overlapped step: those steps were the whole excess.
With the peek it runs none (tests/spec_decode/test_spec_peek.py counts the steps).
So only a step that finished the one in flight for speculation and then had nothing for any row
counts as empty: a draft model's (it cannot be asked without the device; it proposes for every
row unless a grammar refuses every proposal), or a host-side proposer's whose stale history found
something and the fresh one did not. EMPTY_STEPS_BEFORE_PAUSE such steps in a row (steps the
proposer had nothing for between them neither extend nor end the streak) pause speculation, with
pausing on (min_speculation_yield above 1): first_pause_steps steps, then one probe; a probe that
proposes nothing again doubles the pause, up to MAX_EMPTY_PAUSE_STEPS (shorter than a low yield's
cap: text that starts repeating later is found within that many steps); a step with proposals
ends the streak and resets this backoff.
The constants stay what they were before the peek (8 and 32): each step the streak counts still
costs a synchronous wait, as every empty step did then, so the evidence needed to pause is the
same, and a longer streak cost the H200's 128-token runs 3-5% in synchronous steps. What changed
is how rarely a host-side proposer fills it: after such a step the next one peeks over exactly the
history the fresh proposal found nothing in, so at most every other step can count, and a
workload must keep finding matches one token too early for 8 of them before it pauses; a pause
then costs it at most 32 steps of missed matches and saves only those waits, so a shorter cap or a
longer streak would change little either way.
"""
from __future__ import annotations

import math

# Weight of the newest step's gain in the estimate once there are more than 1 / YIELD_WEIGHT steps:
# about the last 7 steps matter (the estimate's variance is w / (2 - w) of a step's), so one
# unlucky step in a good run does not pause.
YIELD_WEIGHT = 0.25
FIRST_PAUSE_STEPS = 8
MAX_PAUSE_STEPS = 256
EMPTY_STEPS_BEFORE_PAUSE = 8
MAX_EMPTY_PAUSE_STEPS = 32


class SpeculationPolicy:
    def __init__(self, num_speculative_tokens: int, disable_batch_tokens: int,
                 disable_by_batch_size: int | None = None, min_speculation_yield: float = 0.0,
                 first_pause_steps: int = FIRST_PAUSE_STEPS, max_pause_steps: int = MAX_PAUSE_STEPS,
                 proposer_cost: float = 0.0) -> None:
        """min_speculation_yield <= 1.0 never pauses (a step yields at least 1 per row) and ignores
        proposer_cost (speculation as asked: the benchmarks' fixed-k runs)."""
        self.k = num_speculative_tokens
        self.disable_batch_tokens = disable_batch_tokens
        self.disable_by_batch_size = disable_by_batch_size
        self.min_yield = min_speculation_yield
        self.proposer_cost = proposer_cost  # the engine sets it from its proposer every step
        self.first_pause, self.max_pause = first_pause_steps, max_pause_steps
        self.num_paused_steps = 0  # since start: steps the pause kept from speculating
        self.reset()

    @property
    def pausing(self) -> bool:
        return self.min_yield > 1.0

    def threshold(self, k: int) -> float:
        """Tokens per row a step of k proposals must yield to pay (see the module docstring)."""
        return self.min_yield * (1.0 + k * self.proposer_cost) if self.pausing else self.min_yield

    def pays(self, k: int) -> bool:
        """Whether a fully accepted step of k proposals reaches the threshold."""
        return not self.pausing or 1 + k >= self.threshold(k)

    def probe_k(self, k: int) -> int:
        """The fewest proposals (at most k) whose fully accepted step pays: a probe's size."""
        return next((j for j in range(1, k + 1) if self.pays(j)), k)

    def reset(self) -> None:
        """Forget what speculation yielded (the engine calls it when it runs out of requests, so
        that each offline batch starts alike); the paused-step count stays."""
        self.estimate = math.inf       # gain; no step observed yet
        self.observed = 0              # steps in the estimate since it (re)started
        self.pause_left = 0            # steps still paused
        self.next_pause = self.first_pause
        self.probing = self.pausing    # the next observed step is a probe (the first one is)
        self.step_k = 0                # k of the step last asked for
        self.empty_streak = 0          # speculating steps in a row in which no row got a proposal
        self.next_empty_pause = self.first_pause
        self.shadow_pending = False    # a shadow probe (begin_shadow) awaits its score

    def batch_k(self, num_decodes: int) -> int:
        """k the batch rule allows at this many running decodes (0: speculation off)."""
        if num_decodes <= 0:
            return 0
        if self.disable_by_batch_size is not None and num_decodes >= self.disable_by_batch_size:
            return 0
        return max(0, min(self.k, self.disable_batch_tokens // num_decodes - 1))

    def tokens_to_propose(self, num_decodes: int) -> int:
        """k for this step given the running decodes (0: do not speculate)."""
        self.step_k = 0
        k = self.batch_k(num_decodes)
        if not k or not self.pays(k):
            return 0
        if self.shadow_pending:  # a shadow probe is being scored: withheld, as a pause withholds
            self.num_paused_steps += 1
            return 0
        if self.pause_left:
            self.pause_left -= 1
            self.num_paused_steps += 1
            return 0
        if self.probing:
            k = self.probe_k(k)
        self.step_k = k
        return k

    def nothing_to_propose(self) -> None:
        """The step tokens_to_propose asked for found nothing to propose before it gave up its
        overlap (a host-side proposer's peek, spec_decode/proposer.py): it runs overlapped, as if
        never asked. Neither paused nor empty; a due probe stays due."""
        self.step_k = 0

    def begin_shadow(self) -> None:
        """The engine took this step's probe as a shadow probe (spec_decode/shadow.py): the step
        runs without speculation and later steps are withheld until observe_shadow or
        cancel_shadow."""
        self.step_k = 0
        self.shadow_pending = True

    def observe_shadow(self, step_yield: float, k: int) -> None:
        """A shadow probe's score: what a verified probe of k proposals would have yielded. It
        decides as a probe does (resume at full k), except that a failed one pauses
        first_pause_steps again, not twice as long: it cost no device time."""
        self.shadow_pending = False
        self.step_k = k
        self.observe(step_yield)
        if self.probing:  # failed
            self.pause_left = self.next_pause = self.first_pause

    def cancel_shadow(self) -> None:
        """No row of the shadow probe could be scored (its sequences ended): the probe stays due."""
        self.shadow_pending = False

    def observe(self, step_yield: float) -> None:
        """A speculating step's yield (see the module docstring); steps where no row got a
        proposal go to observe_empty instead."""
        self.empty_streak = 0
        self.next_empty_pause = self.first_pause
        if not self.pausing:
            return
        gain = step_yield / self.threshold(self.step_k)
        if self.probing:
            if gain >= 1.0:
                self.probing = False
                self.estimate, self.observed = gain, 1
                self.next_pause = self.first_pause
            else:
                self._pause()
            return
        self.observed += 1
        self.estimate = gain if self.observed == 1 else \
            self.estimate + max(1.0 / self.observed, YIELD_WEIGHT) * (gain - self.estimate)
        if self.estimate < 1.0:
            self._pause()

    def observe_empty(self) -> None:
        """A speculating step in which no row got a proposal (see the module docstring)."""
        if not self.pausing:
            return
        self.empty_streak += 1
        if self.empty_streak >= EMPTY_STEPS_BEFORE_PAUSE:
            self.pause_left = self.next_empty_pause
            self.next_empty_pause = min(2 * self.next_empty_pause, MAX_EMPTY_PAUSE_STEPS)
            self.probing = True  # speculation restarts with a probe

    def _pause(self) -> None:
        self.pause_left = self.next_pause
        self.next_pause = min(2 * self.next_pause, self.max_pause)
        self.probing = True
