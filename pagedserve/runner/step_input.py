"""StepInput: one step as plain host data, what ModelRunner.execute_model runs on every rank.

Its own module so that the runner's start-up helpers (warmup.py) build steps without importing
model_runner.py, which imports them.
"""
from __future__ import annotations

from dataclasses import dataclass

from pagedserve.runner.batch import HostBatch
from pagedserve.runner.row_tracker import RowInputs


@dataclass
class StepInput:
    """Everything one step needs, as plain host data: the plan minus the Sequence objects.

    Built once (on tensor-parallel rank 0) by prepare_inputs and run by every rank's
    execute_model, each against its own KV pool under the same block ids. With `rows` the
    block tables live on the device (request_state.py): batch then carries no tables, and rows
    carries what changed since the last step, which every rank applies alike. Without it (warm-up,
    profiling, a scheduler without a table log) batch carries every table and nothing persists.
    share_sampled (tensor parallelism, overlapped steps): the step ends with rank 0's sampled ids
    broadcast to every rank, for the next step's placeholders (sampled_ids.py).
    """
    blocks_to_swap_out: list[tuple[int, int]]
    blocks_to_swap_in: list[tuple[int, int]]
    blocks_to_copy: list[tuple[int, int]]
    batch: HostBatch | None
    rows: RowInputs | None = None
    share_sampled: bool = False
