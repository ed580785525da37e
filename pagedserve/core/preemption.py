"""Preemption: a running group gives its blocks back when a decode finds none free.

Scheduler._schedule_running (core/scheduler.py) picks the victim, a running group not yet
scheduled this step, the most recently admitted first; here it leaves running, one of two ways:
  - swap: its blocks are copied out to the CPU pool (SchedulerOutput.blocks_to_swap_out) and it
    waits in swapped, in order of admission, until a later step brings it back (core/admission.py);
  - recompute: its blocks are freed, its computed tokens forgotten, and it goes to the front of
    waiting, to be prefilled again (prompt and outputs so far) once it is admitted again.
preemption_mode "swap" or "recompute" picks one; "auto" the cheaper by the runner's measured
costs (swap_seconds_per_block against recompute_seconds_per_token). A manager that cannot swap
the group out (the contiguous baselines, a full CPU pool) recomputes.

Multi-sequence groups (n > 1) are preempted whole. They prefer swap even when recompute is
configured (as vLLM does); with no swap space each sequence recomputes its own tokens
independently (prompt + its own outputs), so outputs stay correct but the shared prompt is
no longer shared until it is re-cached.

Everything here acts on the Scheduler's own state; the mixin holds none of its own.
"""
from __future__ import annotations

import bisect

from pagedserve.core.plan import SchedulerOutput
from pagedserve.sequence import SequenceGroup, SequenceStatus

RUNNING, WAITING, SWAPPED = SequenceStatus.RUNNING, SequenceStatus.WAITING, SequenceStatus.SWAPPED


class Preemption:
    """Mixin of Scheduler: running groups out to swapped or back to waiting."""

    def _preemption_uses_swap(self, group: SequenceGroup) -> bool:
        cfg = self.scheduler_config
        mgr = self.kv_cache_manager
        if not (mgr.supports_swap and mgr.can_swap_out(group)):
            return False
        if len(group.unfinished_seqs()) > 1 or cfg.preemption_mode == "swap":
            return True
        if cfg.preemption_mode == "recompute":
            return False
        seqs = group.seqs_with_status(RUNNING)
        blocks = len({b for s in seqs for b in mgr.get_block_table(s)})
        tokens = sum(s.num_computed_tokens for s in seqs)
        return blocks * cfg.swap_seconds_per_block < tokens * cfg.recompute_seconds_per_token

    def _preempt(self, group: SequenceGroup, out: SchedulerOutput) -> None:
        """Victims leave running: swapped out (kept in order of admission) or reset to the front of waiting."""
        if self._preemption_uses_swap(group):
            out.blocks_to_swap_out.extend(self.kv_cache_manager.swap_out(group))
            self.num_swap_outs += 1
            for s in group.seqs_with_status(RUNNING):
                s.status = SWAPPED
            key = self.order_key
            self.swapped.insert(bisect.bisect_right(self.swapped, key(group), key=key), group)
        else:
            for s in group.unfinished_seqs():
                self.kv_cache_manager.free(s)
                s.num_computed_tokens = 0
                s.status = WAITING
            if self.scheduler_config.scheduling_policy == "priority":
                self._insert_waiting(group)
            else:
                self.waiting.appendleft(group)
        out.preempted.append(group)
        self.num_preemptions += 1
