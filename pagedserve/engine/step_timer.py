"""StepTimer: an optional phase clock for LLMEngine.step, for benchmarks and profiling.

The engine holds `step_timer = None` and only calls it when one is attached, so the cost
when off is one attribute test per phase. Each mark charges the wall time since the
previous mark to a phase. On CUDA a mark may synchronize first (pass `sync`), so a phase
that launches device work is charged its device time and the next phase starts clean.
"""
from __future__ import annotations

import time
from typing import Callable


class StepTimer:
    def __init__(self, sync: Callable[[], None] | None = None, clock: Callable[[], float] = time.perf_counter):
        """clock: time.perf_counter (wall), or time.thread_time to count only this thread's CPU
        time (steadier on a shared CPU, but blind to device waits)."""
        self.sync = sync
        self.clock = clock
        self.records: list[dict[str, float]] = []   # one {phase: seconds} per step
        self._last = 0.0

    def begin(self) -> None:
        """Start a step (called at the top of LLMEngine.step)."""
        if self.sync is not None:
            self.sync()
        self.records.append({})
        self._last = self.clock()

    def mark(self, phase: str, sync: bool = False) -> None:
        """Charge the time since the last mark to `phase` (synchronizing first if asked)."""
        if sync and self.sync is not None:
            self.sync()
        now = self.clock()
        rec = self.records[-1]
        rec[phase] = rec.get(phase, 0.0) + now - self._last
        self._last = now

    def reset(self) -> None:
        self.records.clear()
