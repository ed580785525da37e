"""TableChangeLog: which device block tables changed since the runner last heard, and how.

Why: the runner keeps every running sequence's block table in a persistent device tensor and
wants to upload only what changed each step. The KV manager is the one place that changes a
table, so it records each change here as it makes it (O(1) per change), and the scheduler hands
the accumulated record to the runner with the next step it plans (SchedulerOutput.table_changes).
Without the log the runner would have to compare every table with what it sent before, every step.

What is recorded, per sequence: the first entry that changed since the last drain (an append
records the old length, a copy-on-write its index, a new table (admission, fork, swap-in) 0),
and whether its device table went away (free, swap-out, preemption by recompute). A table that
went away and came back within one window is reported as both: removal first, then the new one.
Tables never shrink otherwise (a speculative step's rejected lookahead blocks are dropped from a
table's end, unrecorded: entries past a table's length are never read, and the next growth
records its first new index), so "entries from index i on" describes every change.

Plain data and no torch: the core stays testable in microseconds.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Iterable


@dataclass
class TableChanges:
    """The device block tables that changed since the previous drained step.

    The runner applies `removed` first, then `updated`: for each (seq_id, first, block_ids), the
    sequence's table entries [first, first + len(block_ids)) are block_ids (it has no more entries)."""
    removed: list[int] = field(default_factory=list)
    updated: list[tuple[int, int, list[int]]] = field(default_factory=list)


class TableChangeLog:
    def __init__(self, existing: Iterable[int] = ()) -> None:
        """existing: the seq ids that already have device tables; they count as new (replaced)."""
        # seq_id -> first entry changed since the last drain
        self._first: dict[int, int] = dict.fromkeys(existing, 0)
        self._removed: set[int] = set()

    def changed(self, seq_id: int, index: int) -> None:
        """Entries from `index` on were written or appended."""
        first = self._first.get(seq_id)
        if first is None or index < first:
            self._first[seq_id] = index

    def replaced(self, seq_id: int) -> None:
        """The sequence has a whole new device table (admission, fork, swap-in)."""
        self._first[seq_id] = 0

    def removed(self, seq_id: int) -> None:
        """The sequence's device table is gone (freed or swapped out)."""
        self._first.pop(seq_id, None)
        self._removed.add(seq_id)

    def __len__(self) -> int:
        return len(self._first) + len(self._removed)

    def drain(self, table_of: Callable[[int], list[int]]) -> TableChanges:
        """Everything recorded since the last drain, with the changed entries read from the live
        tables (table_of(seq_id): the sequence's device block ids now); the log starts empty again."""
        out = TableChanges(sorted(self._removed),
                           [(sid, first, table_of(sid)[first:]) for sid, first in self._first.items()])
        self._first = {}
        self._removed = set()
        return out
