"""A simulator run (pagedserve.sim.simulate: the real Scheduler and KV managers) that advances
only when asked, so the dashboard can play, pause and step it.

The run lives in a daemon thread that blocks in simulate()'s on_step hook after every step
until it is granted more steps; each step's KV snapshot is taken there, on that thread, while
the scheduler is quiet. Memory stays O(blocks): only the latest snapshot is kept.
"""
from __future__ import annotations

import threading
from typing import Any

from pagedserve.config import KV_ALLOCATORS
from pagedserve.core.kv_state import kv_cache_state
from pagedserve.dashboard.feed import make_frame


class _Stopped(Exception):
    """Raised inside the simulator thread to end a run that was replaced or closed."""


class SimReplay:
    def __init__(self, allocator: str = "paged", **sim_kwargs: Any) -> None:
        self.sim_kwargs = sim_kwargs
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self.reset(allocator)

    def reset(self, allocator: str) -> None:
        """Start a fresh run with this allocator (paused before its first step)."""
        if allocator not in KV_ALLOCATORS:
            raise ValueError(f"allocator must be one of {KV_ALLOCATORS}, got {allocator!r}")
        self.close()
        with self._cond:
            self.allocator = allocator
            self._stop = False
            self._granted = 0
            self._step = 0
            self._done = False
            self._error: BaseException | None = None
            self._state: dict | None = None
        self._thread = threading.Thread(target=self._run, name=f"sim-{allocator}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        from pagedserve.sim import simulate
        try:
            simulate(allocator=self.allocator, on_step=self._on_step, **self.sim_kwargs)
        except _Stopped:
            return
        except BaseException as e:  # reported to the caller of advance()
            with self._cond:
                self._error = e
        with self._cond:
            self._done = True
            self._cond.notify_all()

    def _on_step(self, step: int, scheduler: Any) -> None:
        state = kv_cache_state(scheduler)
        with self._cond:
            self._step, self._state = step, state
            self._cond.notify_all()
            while self._granted == 0 and not self._stop:
                self._cond.wait()
            if self._stop:
                raise _Stopped
            self._granted -= 1

    def advance(self, n: int, timeout: float = 60.0) -> dict:
        """Run n more steps (0: none) and return the latest frame; fewer if the run ends."""
        if n < 0:
            raise ValueError(f"n must be >= 0, got {n}")
        with self._cond:
            # The thread is parked after step k holding the grant for k+1..: the first step of
            # a run needs no grant, so the initial frame (step 1) appears on its own.
            target = max(self._step, 1) + n
            self._granted += n
            self._cond.notify_all()
            if not self._cond.wait_for(lambda: self._done or self._error is not None
                                       or (self._step >= target and self._granted == 0), timeout):
                raise TimeoutError(f"the simulator did not reach step {target} in {timeout} s")
            if self._error is not None:
                raise RuntimeError(f"the simulation failed: {self._error!r}") from self._error
            return self.frame()

    def frame(self) -> dict:
        """The latest snapshot with the replay's position ('sim')."""
        if self._state is None:
            raise RuntimeError("the simulation has not taken a step yet")
        state = make_frame(None, self._state)  # a full frame, as the live stream's first
        state["version"] = self._step
        state["sim"] = {"step": self._step, "done": self._done, "allocator": self.allocator,
                        "workload": self.sim_kwargs.get("workload", "sharegpt-like")}
        return state

    def close(self) -> None:
        if self._thread is None:
            return
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        self._thread.join(timeout=10)
        self._thread = None
