"""RowTracker: the host half of the runner's persistent per-request device state.

The device keeps one row per sequence with a device block table (runner/request_state.py): its
block ids and how many of its tokens have KV computed. This class, run on tensor-parallel rank 0
only (in prepare_inputs), assigns those rows and turns each step's table changes (the core's
TableChanges) into a RowInputs: plain host arrays that every rank applies alike, so the device
states of all ranks stay equal without any rank but 0 seeing the plan.

Rows are stable for a sequence's lifetime and the step names the row of each scheduled sequence
(a gather by row index), rather than keeping rows compacted in batch order as vLLM's InputBatch
does: our batch order (decodes first, then prefill chunks, by admission) changes whenever a
sequence switches phase or a group is preempted, and compaction would move whole rows on every
finish. Freed rows are reused lowest first, so the rows in use stay near the number of live tables.

It also mirrors the device's per-row computed-token count, to know when a decode's position
cannot be derived on the device (a row's first step, or any step that does not start where
the row's previous one ended) and must be sent instead.
"""
from __future__ import annotations

import heapq
import os
from dataclasses import dataclass

import numpy as np

from pagedserve.core.plan import SchedulerOutput
from pagedserve.core.table_log import TableChanges

_I64 = np.int64

# "0": rebuild and upload every block table each step instead of keeping them on the device (A/B runs).
INCREMENTAL_ENV = "PAGEDSERVE_INCREMENTAL_INPUTS"


def incremental_inputs_enabled() -> bool:
    """PAGEDSERVE_INCREMENTAL_INPUTS: "1" or "auto" (the default) on, "0" off (the full rebuild every
    step, kept for A/B runs). On every device: the path has passed its CUDA tests with graphs on the H200
    (tests/runner/test_incremental_inputs.py::test_state_on_cuda_with_graphs) and measured level
    with the rebuild there (benchmarks/results/h200/host_overhead_incr*.json)."""
    mode = os.environ.get(INCREMENTAL_ENV, "auto").strip().lower()
    if mode not in ("auto", "0", "1"):
        raise ValueError(f"{INCREMENTAL_ENV} must be auto, 0 or 1, got {mode!r}")
    return mode != "0"


def _empty(dtype=_I64) -> np.ndarray:
    return np.zeros(0, dtype=dtype)


@dataclass
class RowInputs:
    """One step's changes to the persistent device state, and the rows the step runs on."""
    num_rows: int              # rows the device state must have (it grows, never shrinks)
    num_cols: int              # block-table columns it must have
    cleared_rows: np.ndarray   # int64: rows freed since the last step, zeroed before anything else
    entry_rows: np.ndarray     # int64 \
    entry_cols: np.ndarray     # int64  > block_table[entry_rows, entry_cols] = entry_vals
    entry_vals: np.ndarray     # int32 /
    rows: np.ndarray           # int64 [S]: the row of each scheduled sequence, in schedule order
    table_lens: np.ndarray     # int64 [S]: blocks in each scheduled sequence's table (host only)
    # Decode-only steps: rows whose computed count the device cannot know; set before the step.
    start_rows: np.ndarray
    start_vals: np.ndarray

    @property
    def num_entries(self) -> int:
        return int(self.entry_rows.shape[0])


class RowTracker:
    def __init__(self, num_rows: int, num_cols: int):
        self.num_rows, self.num_cols = max(1, num_rows), max(1, num_cols)
        self.row_of: dict[int, int] = {}                 # seq_id -> row
        self._free: list[int] = list(range(self.num_rows))  # a heap: lowest row first
        # The device's computed-token count of each row after the last step; -1: unknown.
        self.computed = np.full(self.num_rows, -1, dtype=_I64)

    def _assign(self, seq_id: int) -> int:
        if not self._free:
            # More live device tables than rows (forks, best_of): double, as the device will.
            grow = self.num_rows
            self._free = list(range(self.num_rows, self.num_rows + grow))
            self.computed = np.concatenate([self.computed, np.full(grow, -1, dtype=_I64)])
            self.num_rows += grow
        row = heapq.heappop(self._free)
        self.row_of[seq_id] = row
        self.computed[row] = -1
        return row

    def _apply_changes(self, changes: TableChanges) -> tuple[np.ndarray, list[int], list[int], list[int]]:
        cleared: list[int] = []
        for sid in changes.removed:
            row = self.row_of.pop(sid, None)
            if row is not None:  # a table freed before the runner ever saw it has no row
                heapq.heappush(self._free, row)
                cleared.append(row)
                self.computed[row] = -1
        e_rows: list[int] = []
        e_cols: list[int] = []
        e_vals: list[int] = []
        for sid, first, ids in changes.updated:
            row = self.row_of.get(sid)
            if row is None:
                row = self._assign(sid)
            n = len(ids)
            e_rows.extend([row] * n)
            e_cols.extend(range(first, first + n))
            e_vals.extend(ids)
            if first + n > self.num_cols:
                self.num_cols = first + n
        return np.asarray(cleared, dtype=_I64), e_rows, e_cols, e_vals

    def step_inputs(self, out: SchedulerOutput, batch) -> RowInputs:
        """step() for one plan and its HostBatch (None when nothing is scheduled). Takes the block
        tables out of the batch: the device has them, so a tensor-parallel step message stays small."""
        n = len(out.scheduled)
        if batch is None:
            table_lens = starts = query_lens = _empty()
        else:
            table_lens = np.fromiter(map(len, batch.block_tables), dtype=_I64, count=n)
            batch.block_tables = []
            starts, query_lens = batch.starts, batch.query_lens
        return self.step(out.table_changes, [s.seq.seq_id for s in out.scheduled], table_lens, starts, query_lens,
                         decode_only=batch is not None and batch.num_decodes == n)

    def step(self, changes: TableChanges, seq_ids: list[int], table_lens: np.ndarray, starts: np.ndarray,
             query_lens: np.ndarray, decode_only: bool) -> RowInputs:
        """Apply the changes, then describe the step over seq_ids (the scheduled sequences in
        schedule order; table_lens, starts and query_lens per sequence), and advance the mirror."""
        cleared, e_rows, e_cols, e_vals = self._apply_changes(changes)
        row_of = self.row_of
        try:
            rows = np.fromiter([row_of[sid] for sid in seq_ids], dtype=_I64, count=len(seq_ids))
        except KeyError as e:
            raise RuntimeError(f"sequence {e.args[0]} is scheduled but its block table never reached the runner "
                               "(the scheduler's table log was enabled after it was admitted)") from None
        start_rows, start_vals = _empty(), _empty()
        if decode_only and len(rows):
            stale = self.computed[rows] != starts
            if stale.any():
                start_rows, start_vals = rows[stale], starts[stale]
        if len(rows):
            self.computed[rows] = starts + query_lens
        return RowInputs(self.num_rows, self.num_cols, cleared, np.asarray(e_rows, dtype=_I64),
                         np.asarray(e_cols, dtype=_I64), np.asarray(e_vals, dtype=np.int32), rows,
                         table_lens, start_rows, start_vals)
