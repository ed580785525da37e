"""The table log (core/table_log.py): a runner that applies only each step's TableChanges to its
own copy of the tables holds exactly the KV manager's device tables at every executed step.

Runs the random interleavings of test_core_invariants (preemption by swap and recompute, forks,
copy-on-write, prefix hits, chunking, aborts, contiguous allocators) with the log on, replaying
every drained change into a mirror the way runner/row_tracker.py does.
"""
from __future__ import annotations

from hypothesis import HealthCheck, settings
from hypothesis.stateful import invariant

from core_helpers import Driver, make_group, make_scheduler
from pagedserve.core.table_log import TableChanges
from pagedserve.sequence import SequenceStatus
from test_core_invariants import SchedulerMachine


def _live(mgr) -> dict[int, list[int]]:
    sids = mgr._block_ids if hasattr(mgr, "_block_ids") else mgr._runs
    return {sid: list(mgr.table_ids(sid)) for sid in sids}


def attach_mirror(sched) -> dict:
    """Turn the log on and check the mirror against the live tables after every drained schedule."""
    sched.enable_table_log()
    mirror: dict[int, list[int]] = {}
    schedule = sched.schedule

    def checked():
        out = schedule()
        changes = out.table_changes
        if out.is_empty:
            assert changes is None  # an empty step is not executed: its changes wait
            return out
        for sid in changes.removed:
            mirror.pop(sid, None)
        for sid, first, ids in changes.updated:
            table = mirror.setdefault(sid, [])
            assert first <= len(table)
            mirror[sid] = table[:first] + ids
        assert mirror == _live(sched.kv_cache_manager)
        return out
    sched.schedule = checked
    return mirror


class TableLogMachine(SchedulerMachine):
    @invariant()
    def log_attached(self):
        # Runs right after setup, before any table exists; then the wrapper checks every step.
        if hasattr(self, "driver") and not hasattr(self, "mirror"):
            self.mirror = attach_mirror(self.sched)


TableLogMachine.TestCase.settings = settings(max_examples=100, stateful_step_count=30, deadline=None,
                                             suppress_health_check=[HealthCheck.too_slow])
TestTableLogMachine = TableLogMachine.TestCase


def test_changes_are_appends_cow_and_removals():
    """The exact record of one small run: admission, a block-crossing decode, a fork, a
    copy-on-write and a free each appear once, in the next executed step's changes."""
    sched = make_scheduler(16, block_size=4)
    sched.enable_table_log()
    g = make_group("a", list(range(7)), max_tokens=8)
    sched.add_seq_group(g)
    seq = g.seqs[0]

    def step(token: int):
        out = sched.schedule()
        sched.update_after_step(out)
        for s in g.seqs:
            if not s.status.finished:
                s.append_token(token)
        return out.table_changes

    assert step(1) == TableChanges([], [(seq.seq_id, 0, [0, 1])])  # admission: 7 tokens, 2 blocks
    assert step(2) == TableChanges([], [])                          # slot 7: still block 1
    assert step(3) == TableChanges([], [(seq.seq_id, 2, [2])])      # slot 8 opens block 2
    child = seq.fork()  # shares blocks 0-2; slot 9 is in the shared block 2
    sched.fork_seq(seq, child)
    g.seqs.append(child)
    # The parent runs first and copies block 2 into block 3 (copy-on-write at index 2); the child
    # then owns block 2 alone and writes in place. The child's whole table is new.
    assert step(4) == TableChanges([], [(child.seq_id, 0, [0, 1, 2]), (seq.seq_id, 2, [3])])
    child.status = SequenceStatus.FINISHED_ABORTED
    sched.free_seq(child)
    assert step(5) == TableChanges([child.seq_id], [])


def test_driver_run_with_log_matches_tables():
    sched = make_scheduler(12, block_size=2, num_cpu_blocks=32, preemption_mode="swap", max_num_batched_tokens=16)
    attach_mirror(sched)
    for i in range(6):
        sched.add_seq_group(make_group(str(i), list(range(i, i + 5 + 2 * i)), max_tokens=6, n=1 + i % 2))
    d = Driver(sched)
    d.run()
    assert d.counts["swap out"] and d.counts["copy-on-write"]
