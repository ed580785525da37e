"""StepTimer: a phase clock for LLMEngine.step, for benchmarks and profiling.

The engine always holds a timer; by default NULL_STEP_TIMER, whose methods do nothing, so the
step loop has no `if timer` checks. Each mark charges the wall time since the previous mark to a
phase. On CUDA a mark may synchronize first (pass `sync`), so a phase that launches device work
is charged its device time and the next phase starts clean.

GPU idle between steps (the host time the GPU waits for): with `gpu_gaps=True` on CUDA the timer
records an event on the compute stream just before a step's first device work (launch_begin) and
just after its last (launch_end). The device reaches launch_begin of step N+1 either right after
step N's last kernel (the host queued N+1 in time: a gap of microseconds) or when the host gets
there (the gap is host time the GPU waited for). gpu_gaps() reads them once the device is idle.
"""
from __future__ import annotations

import time
from typing import Callable


class NullStepTimer:
    """Does nothing: what the engine holds when nobody measures."""

    def begin(self) -> None:
        pass

    def mark(self, phase: str, sync: bool = False) -> None:
        pass

    def launch_begin(self, plan=None) -> None:
        """plan: the step's SchedulerOutput (engine/step_trace.py records its shape)."""
        pass

    def launch_end(self) -> None:
        pass


NULL_STEP_TIMER = NullStepTimer()


class StepTimer(NullStepTimer):
    def __init__(self, sync: Callable[[], None] | None = None, clock: Callable[[], float] = time.perf_counter,
                 gpu_gaps: bool = False):
        """clock: time.perf_counter (wall), or time.thread_time to count only this thread's CPU
        time (steadier on a shared CPU, but blind to device waits). gpu_gaps: record CUDA events
        around each step's device work (needs CUDA; use without sync, or the syncs are the gaps)."""
        self.sync = sync
        self.clock = clock
        self.records: list[dict[str, float]] = []   # one {phase: seconds} per step
        self._last = 0.0
        self._events: list[tuple[object, object]] = []
        self._gpu_gaps = gpu_gaps

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

    def _event(self):
        import torch
        e = torch.cuda.Event(enable_timing=True)
        e.record()
        return e

    def launch_begin(self, plan=None) -> None:
        if self._gpu_gaps:
            self._events.append((self._event(), None))

    def launch_end(self) -> None:
        """After the step's last device work is queued (the first call per step counts)."""
        if self._gpu_gaps and self._events and self._events[-1][1] is None:
            self._events[-1] = (self._events[-1][0], self._event())

    def gpu_gaps(self) -> list[float]:
        """Seconds the device sat between the end of one step's work and the start of the next's
        (one per consecutive pair of launched steps). Synchronizes the device."""
        import torch
        torch.cuda.synchronize()
        ev = [e for e in self._events if e[1] is not None]
        return [ev[i][1].elapsed_time(ev[i + 1][0]) / 1e3 for i in range(len(ev) - 1)]

    def gpu_busy(self) -> list[float]:
        """Seconds from each step's first to last device work (launch_begin to launch_end)."""
        import torch
        torch.cuda.synchronize()
        return [b.elapsed_time(e) / 1e3 for b, e in self._events if e is not None]

    def reset(self) -> None:
        self.records.clear()
        self._events.clear()
