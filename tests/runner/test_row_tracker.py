"""RowTracker and DeviceRequestState without an engine: row reuse, growth, and the delta arrays."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from pagedserve.core.table_log import TableChanges
from pagedserve.runner import request_state
from pagedserve.runner.batch import HostBatch
from pagedserve.runner.request_state import DeviceRequestState
from pagedserve.runner.row_tracker import RowTracker

I64 = np.int64


def _apply(tracker: RowTracker, state: DeviceRequestState, changes: TableChanges) -> None:
    none = np.zeros(0, dtype=I64)
    rows = tracker.step(changes, [], none, none, none, decode_only=False)
    assert state.prepare(rows, None, block_size=4) is None


def _table(state: DeviceRequestState, tracker: RowTracker, sid: int) -> list[int]:
    row = state.block_table[tracker.row_of[sid]].tolist()
    return row[:len(row) - next((i for i, v in enumerate(reversed(row)) if v), len(row))]


def test_rows_are_reused_lowest_first_and_grow_by_doubling():
    tracker = RowTracker(num_rows=2, num_cols=2)
    state = DeviceRequestState(2, 2, torch.device("cpu"))
    _apply(tracker, state, TableChanges([], [(10, 0, [5]), (11, 0, [6, 7])]))
    assert tracker.row_of == {10: 0, 11: 1}
    # A third table doubles the rows; a table longer than the columns widens them. Old rows stay.
    _apply(tracker, state, TableChanges([], [(12, 0, [1, 2, 3])]))
    assert tracker.row_of[12] == 2 and tracker.num_rows == 4 and tracker.num_cols == 3
    assert state.block_table.shape == (4, 3)
    assert [_table(state, tracker, s) for s in (10, 11, 12)] == [[5], [6, 7], [1, 2, 3]]
    # Freeing row 0 zeroes it; the next new table takes it (lowest first), appends extend in place.
    _apply(tracker, state, TableChanges([10], [(13, 0, [9]), (11, 2, [8])]))
    assert tracker.row_of == {11: 1, 12: 2, 13: 0}
    assert _table(state, tracker, 13) == [9] and _table(state, tracker, 11) == [6, 7, 8]
    # Removed and back in one window (a swap-out and swap-in): the row is cleared, then rewritten.
    _apply(tracker, state, TableChanges([11], [(11, 0, [4])]))
    assert _table(state, tracker, 11) == [4]
    assert state.last_upload == {"cleared_rows": 8, "entry_rows": 8, "entry_cols": 8, "entry_vals": 4}


def test_decode_positions_come_from_the_device_and_stale_rows_are_corrected(monkeypatch):
    """A decode-only step uploads rows and tokens; a row whose start the mirror does not know
    (new, or moved by something other than a step) gets its start sent once. One copy per step."""
    copies = []
    original = request_state._to_device
    monkeypatch.setattr(request_state, "_to_device", lambda arrays, device: (copies.append(len(arrays)),
                                                                             original(arrays, device))[1])
    bs = 4
    tracker = RowTracker(num_rows=4, num_cols=4)
    state = DeviceRequestState(4, 4, torch.device("cpu"))

    def decode(sids, starts, changes=TableChanges()):
        starts = np.asarray(starts, dtype=I64)
        n = len(sids)
        lens = np.asarray([4] * n, dtype=I64)
        rows = tracker.step(changes, sids, lens, starts, np.ones(n, dtype=I64), decode_only=True)
        batch = HostBatch(np.arange(n, dtype=I64), starts, np.ones(n, dtype=I64), [], np.ones(n, dtype=bool), n)
        return rows, state.prepare(rows, batch, bs)

    tables = TableChanges([], [(1, 0, [3, 4, 5, 6]), (2, 0, [7, 8, 9, 10])])
    rows, inp = decode([1, 2], [5, 9], tables)
    assert rows.start_rows.tolist() == [0, 1]  # new rows: their starts travel
    assert inp.positions.tolist() == [5, 9]
    assert inp.attn_meta.slot_mapping.tolist() == [4 * bs + 1, 9 * bs + 1]
    assert inp.attn_meta.seq_lens.tolist() == [6, 10]
    rows, inp = decode([2, 1], [10, 6])  # the order may change: rows follow the sequences
    assert len(rows.start_rows) == 0 and set(state.last_upload) == {"rows", "input_ids"}
    assert inp.positions.tolist() == [10, 6]
    assert inp.attn_meta.block_tables.tolist() == [[7, 8, 9, 10], [3, 4, 5, 6]]
    rows, inp = decode([1], [3])  # seq 1 recomputed from elsewhere: its start is sent again
    assert rows.start_rows.tolist() == [0] and inp.positions.tolist() == [3]
    assert state.computed.tolist()[:2] == [4, 11]
    assert len(copies) == 3 and all(n >= 2 for n in copies)


def test_incremental_inputs_switch(monkeypatch):
    from pagedserve.runner.row_tracker import INCREMENTAL_ENV, incremental_inputs_enabled
    monkeypatch.delenv(INCREMENTAL_ENV, raising=False)
    assert incremental_inputs_enabled()
    monkeypatch.setenv(INCREMENTAL_ENV, "auto")
    assert incremental_inputs_enabled()
    monkeypatch.setenv(INCREMENTAL_ENV, "1")
    assert incremental_inputs_enabled()
    monkeypatch.setenv(INCREMENTAL_ENV, "0")
    assert not incremental_inputs_enabled()
    monkeypatch.setenv(INCREMENTAL_ENV, "yes")
    with pytest.raises(ValueError, match=INCREMENTAL_ENV):
        incremental_inputs_enabled()
