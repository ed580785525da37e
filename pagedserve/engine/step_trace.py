"""StepTrace: what each step of a serving engine core was, and how long the device spent on it.

Why: a benchmark's inter-token latency mixes the device's time per step with everything around
it (the core's host work, the API server, the client). Under real serving load this records,
for every launched step, its host launch time (`t`, Unix seconds), its shape (sequences,
decodes, tokens, and `context`: the KV positions its attention reads, the sum of the scheduled
sequences' context lengths) and two device-side durations from CUDA events on the compute stream: busy
(first to last device work of the step) and the gap before it (the device idle since the
previous step's last work: host time it waited for), and, when the engine core gave it a
`graph_path_of` source, how the runner ran the step's forward (`graph`: one of
runner/model_runner.py's GRAPH_PATHS, rank 0's).
Set PAGEDSERVE_STEP_TRACE=/path/file.jsonl in the engine core's environment; the core appends
one JSON line per step, nothing synchronized: each launch_end (the step's work queued, the device
busy with it) turns the steps the device has already finished into lines, a step or two at a
time, and they are appended every WRITE_EVERY lines and whenever the core goes idle.
benchmarks/serving/step_trace_summary.py groups the lines by batch size.

Under load the trace used to wait for 4096 steps and then convert them all in one go, inside the
launch of the next step: 60-102 ms with the device idle, on the 4096th step after every idle
period of every committed serving trace (serving_runs_e962a33 .. serving_runs_ba7b152). The
serving figures measured with the trace on carry that stall (once per ~20 s at 10 req/s).

It is a StepTimer (engine/step_timer.py) with gpu_gaps on: the engine marks launch_begin and
launch_end around each step's device work, as it does for host_overhead.py.
"""
from __future__ import annotations

import json
import os
import time
from typing import Callable

from pagedserve.engine.step_timer import StepTimer

STEP_TRACE_ENV = "PAGEDSERVE_STEP_TRACE"
WRITE_EVERY = 512  # finished lines kept before one append to the file (~60 KB)


class StepTrace(StepTimer):
    def __init__(self, path: str):
        super().__init__(None, time.perf_counter, gpu_gaps=True)
        self.path = path
        self._shapes: list[dict] = []  # one per launch_begin, as _events: the step's line so far
        self._prev_end = None  # the last converted step's end event
        self._lines: list[str] = []  # converted, not yet appended to the file
        # Asked at launch_end, once the step's forward is queued: how it ran (None: unknown).
        self.graph_path_of: Callable[[], str | None] | None = None

    def begin(self) -> None:
        # Phases are not traced: keep records from growing without bound.
        self.records.clear()
        super().begin()

    def launch_begin(self, plan=None) -> None:
        super().launch_begin(plan)
        shape = {"t": round(time.time(), 4), "seqs": 0, "decodes": 0, "tokens": 0, "context": 0}
        if plan is not None:
            shape.update(seqs=len(plan.scheduled), decodes=plan.num_decodes, tokens=plan.num_batched_tokens,
                         context=sum(s.context_len for s in plan.scheduled))
        self._shapes.append(shape)

    def launch_end(self) -> None:
        first = bool(self._events) and self._events[-1][1] is None  # only the step's first call counts
        super().launch_end()
        if first and self.graph_path_of is not None:
            self._shapes[-1]["graph"] = self.graph_path_of()
        if first:
            self._convert_finished()
            if len(self._lines) >= WRITE_EVERY:
                self._append()

    def _convert_finished(self) -> int:
        """Turn the steps whose both events are complete into lines (oldest first); returns how many."""
        done = 0
        for begin, end in self._events:
            if end is None or not end.query():
                break
            gap = None if self._prev_end is None else round(self._prev_end.elapsed_time(begin), 4)
            self._lines.append(json.dumps({**self._shapes[done], "busy_ms": round(begin.elapsed_time(end), 4),
                                           "gap_ms": gap}))
            self._prev_end = end
            done += 1
        if done:
            del self._events[:done], self._shapes[:done]
        return done

    def _append(self) -> None:
        if self._lines:
            with open(self.path, "a") as f:
                f.write("\n".join(self._lines) + "\n")
            self._lines.clear()

    def flush(self, idle: bool = False) -> int:
        """Append every finished step's line to the file; returns how many lines it appended.
        idle: the engine has nothing to run, so the next step's gap would be idle time, not a
        wait for the host: it gets none."""
        self._convert_finished()
        if idle:
            self._prev_end = None
        n = len(self._lines)
        self._append()
        return n


def step_trace_from_env() -> StepTrace | None:
    path = os.environ.get(STEP_TRACE_ENV, "").strip()
    return StepTrace(path) if path else None
