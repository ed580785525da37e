"""Steps 3 and 4 of Scheduler.schedule() (core/scheduler.py): groups join running.

Only in a step that preempted nothing: swapped groups come back first (their blocks copied back
from the CPU pool), FCFS by admission; only once none is left swapped are waiting groups
admitted, FCFS. Each queue stops at the first group that does not fit (max_num_seqs sequences,
the token budget, free blocks), so no later group overtakes it. A waiting group that can never
run is ignored (SchedulerOutput.ignored), except one the cache cannot hold that ran before (a
recompute preemption put it back), which ends as if it hit max_model_len. A group admitted for
the first time gets its admission number (admitted_at): running and swapped keep that order.

Draining (SchedulerConfig.long_prefill_drain = N > 0): a long prompt's prefill makes every step
it shares with decodes long (~0.25 s at 100k tokens on the H200), so a running request a few
tokens from its max_tokens that meets it waits out the whole prefill (seconds) for those tokens.
A fresh prompt of P >= max(N, long_prefill_drain_min_tokens) tokens at the head of waiting therefore
waits while some running request has at most as many tokens left as the prompt may still wait
steps, P // N steps in all: those requests finish first, in decode-only steps, and the prompt's
first token comes at most P // N such steps later. Only max_tokens bounds what is left (a stop
string or EOS only ends a request sooner).

Everything here acts on the Scheduler's own state; the mixin holds none of its own.
"""
from __future__ import annotations

import bisect
from operator import attrgetter

from pagedserve.core.kv_cache_manager import AllocStatus
from pagedserve.core.plan import SchedulerOutput
from pagedserve.sequence import SequenceGroup, SequenceStatus

RUNNING, WAITING, SWAPPED = SequenceStatus.RUNNING, SequenceStatus.WAITING, SequenceStatus.SWAPPED

ADMISSION_ORDER = attrgetter("admitted_at")  # running and swapped are kept in admission order
PRIORITY_ORDER = attrgetter("priority", "admitted_at")  # ... or, under the priority policy, in this one
WAITING_ORDER = attrgetter("priority", "arrived_at")  # waiting, under the priority policy


class Admission:
    """Mixin of Scheduler: swapped and waiting groups into running."""

    def _seq_cost(self, group: SequenceGroup) -> int:
        """Sequences the group occupies now or will after its prompt forks into best_of."""
        live = len(group.unfinished_seqs())
        if len(group.seqs) == 1 and not group.seqs[0].output_token_ids:
            return max(live, group.sampling_params.best_of or 1)
        return live

    def _num_running_seqs(self) -> int:
        return sum(self._seq_cost(g) for g in self.running)

    def _schedule_swapped(self, scheduled: list, out: SchedulerOutput) -> None:
        mgr = self.kv_cache_manager
        # Counted once and kept up to date as groups join: a sum per admission was quadratic.
        running_seqs = self._num_running_seqs()
        while self.swapped:
            group = self.swapped[0]
            seqs = group.seqs_with_status(SWAPPED)
            if running_seqs + self._seq_cost(group) > self.scheduler_config.max_num_seqs:
                break
            if sum(1 for s in seqs if s.is_decode) > self._budget or not mgr.can_swap_in(group):
                break
            self.swapped.pop(0)
            out.blocks_to_swap_in.extend(mgr.swap_in(group))
            self.num_swap_ins += 1
            for s in seqs:
                s.status = RUNNING
            self._insert_running(group)
            running_seqs += self._seq_cost(group)
            for s in seqs:
                if s.is_decode:
                    if mgr.can_append_slots([(s, 1)]):
                        scheduled.append(self._run(group, s, 1, out))
                else:
                    self._schedule_prefill(group, s, scheduled, out)

    def _schedule_waiting(self, scheduled: list, out: SchedulerOutput) -> None:
        mgr = self.kv_cache_manager
        cfg = self.scheduler_config
        # Counted once and kept up to date as groups join: a sum per admission made admitting a
        # thousand prefix-cached prompts in one step quadratic (0.23 s of host time on our CPU).
        running_seqs = self._num_running_seqs()
        while self.waiting and self._budget > 0:
            group = self.waiting[0]
            seqs = group.seqs_with_status(WAITING)
            too_long = any(s.num_tokens > cfg.max_model_len for s in seqs)
            status = AllocStatus.NEVER if too_long else mgr.can_allocate(group)
            if status is AllocStatus.NEVER and group.admitted_at is not None:
                self.waiting.popleft()
                self._finish_full(group)
                self._insert_running(group)  # handed back by free_finished_seq_groups()
                running_seqs += self._seq_cost(group)
                continue
            if status is AllocStatus.NEVER or (group.sampling_params.best_of or 1) > cfg.max_num_seqs:
                self.waiting.popleft()
                for s in seqs:
                    s.status = SequenceStatus.FINISHED_IGNORED
                out.ignored.append(group)
                continue
            if status is AllocStatus.LATER:
                break
            if running_seqs + self._seq_cost(group) > cfg.max_num_seqs:
                break
            if not cfg.enable_chunked_prefill and max(s.num_tokens for s in seqs) > self._budget:
                break
            if cfg.long_prefill_drain and self._drains_first(group):
                break
            self._drain_waits.pop(group.request_id, None)
            self.waiting.popleft()
            mgr.allocate(group)
            if group.admitted_at is None:
                group.admitted_at = next(self._admissions)
            for s in seqs:
                s.status = RUNNING
            self._insert_running(group)
            running_seqs += self._seq_cost(group)
            for s in seqs:
                self._schedule_prefill(group, s, scheduled, out)

    def _drains_first(self, group: SequenceGroup) -> bool:
        """Whether the fresh long prompt `group` waits this step for running requests near their
        end (draining, above); counts the step against its allowance if so."""
        cfg = self.scheduler_config
        prompt_len = len(group.prompt_token_ids)
        if group.admitted_at is not None or prompt_len < max(cfg.long_prefill_drain, cfg.long_prefill_drain_min_tokens):
            return False
        waited = self._drain_waits.get(group.request_id, 0)
        allowance = prompt_len // cfg.long_prefill_drain - waited
        if allowance <= 0 or not any(0 < left <= allowance for left in self._tokens_left_running()):
            return False
        self._drain_waits[group.request_id] = waited + 1
        return True

    def _tokens_left_running(self):
        """Tokens each running single-sequence request in decode may still generate (max_tokens
        less its output and in-flight tokens); requests without max_tokens or with forks are skipped."""
        for g in self.running:
            max_tokens = g.sampling_params.max_tokens
            if max_tokens is None or len(g.seqs) != 1:
                continue
            s = g.seqs[0]
            if s.status is RUNNING and s.is_decode:
                yield max_tokens - len(s.output_token_ids) - s.num_inflight_tokens

    def _insert_running(self, group: SequenceGroup) -> None:
        # A search, not a list of every key per insert (admitting a thousand groups was quadratic).
        key = self.order_key
        self.running.insert(bisect.bisect_right(self.running, key(group), key=key), group)
