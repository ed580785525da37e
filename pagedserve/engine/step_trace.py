"""StepTrace: what each step of a serving engine core was, and how long the device spent on it.

Why: a benchmark's inter-token latency mixes the device's time per step with everything around
it (the core's host work, the API server, the client). Under real serving load this records,
for every launched step, its host launch time (`t`, Unix seconds), its shape (sequences,
decodes, tokens, and `context`: the KV positions its attention reads, the sum of the scheduled
sequences' context lengths) and two device-side durations from CUDA events on the compute stream: busy
(first to last device work of the step) and the gap before it (the device idle since the
previous step's last work: host time it waited for).
Set PAGEDSERVE_STEP_TRACE=/path/file.jsonl in the engine core's environment; the core appends
one JSON line per step whenever it goes idle (and every FLUSH_EVERY steps under load, for the
steps already done), so nothing is synchronized mid-step. benchmarks/step_trace_summary.py
groups the lines by batch size.

It is a StepTimer (engine/step_timer.py) with gpu_gaps on: the engine marks launch_begin and
launch_end around each step's device work, as it does for host_overhead.py.
"""
from __future__ import annotations

import json
import os
import time

from pagedserve.engine.step_timer import StepTimer

STEP_TRACE_ENV = "PAGEDSERVE_STEP_TRACE"
FLUSH_EVERY = 4096


class StepTrace(StepTimer):
    def __init__(self, path: str):
        super().__init__(None, time.perf_counter, gpu_gaps=True)
        self.path = path
        self._shapes: list[tuple[float, int, int, int, int]] = []  # one per launch_begin, as _events
        self._prev_end = None  # the last written step's end event

    def begin(self) -> None:
        # Phases are not traced: keep records from growing without bound.
        self.records.clear()
        super().begin()

    def launch_begin(self, plan=None) -> None:
        super().launch_begin(plan)
        now = time.time()
        if plan is None:
            self._shapes.append((now, 0, 0, 0, 0))
        else:
            self._shapes.append((now, len(plan.scheduled), plan.num_decodes, plan.num_batched_tokens,
                                 sum(s.context_len for s in plan.scheduled)))
        if len(self._events) >= FLUSH_EVERY:
            self.flush()

    def flush(self, idle: bool = False) -> int:
        """Append the finished steps (both events complete) to the file; returns how many.
        idle: the engine has nothing to run, so the next step's gap would be idle time, not a
        wait for the host: it gets none."""
        done = 0
        for begin, end in self._events:
            if end is None or not end.query():
                break
            done += 1
        if done == 0:
            if idle:
                self._prev_end = None
            return 0
        lines = []
        for (begin, end), (t, seqs, decodes, tokens, context) in zip(self._events[:done], self._shapes[:done]):
            gap = None if self._prev_end is None else round(self._prev_end.elapsed_time(begin), 4)
            lines.append(json.dumps({"t": round(t, 4), "seqs": seqs, "decodes": decodes, "tokens": tokens,
                                     "context": context,
                                     "busy_ms": round(begin.elapsed_time(end), 4), "gap_ms": gap}))
            self._prev_end = end
        del self._events[:done], self._shapes[:done]
        if idle:
            self._prev_end = None
        with open(self.path, "a") as f:
            f.write("\n".join(lines) + "\n")
        return done


def step_trace_from_env() -> StepTrace | None:
    path = os.environ.get(STEP_TRACE_ENV, "").strip()
    return StepTrace(path) if path else None
