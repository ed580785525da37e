"""The start-up before the first phase command: where each rank is, bounded, and visible.

Between rank 0 spawning its workers and the first start-up phase (load_model), every rank goes
through sub-steps that wait on the others: "spawn", "start" (a worker's interpreter is up),
"join store" (the TCPStore rendezvous), "control group" (gloo), then, inside init_runner,
"set device", "compute group" (NCCL on GPUs) and "build runner". A StartupTrace records each
sub-step as the rank enters it:

- in a per-rank file under PAGEDSERVE_TP_STARTUP_DIR (rank 0 creates it and passes it to the
  workers it spawns), readable before any rank has reached the store;
- in the store under `startup/<rank>` once the rank has joined it (torchrun's ranks only have this);
- on stderr, one line with the rank, the sub-step and the elapsed time, when PAGEDSERVE_TP_DEBUG=1.

Every pre-phase wait is bounded by startup_bound() seconds. The trace also arms
faulthandler.dump_traceback_later(startup_bound()) for this period: a C thread that dumps every
Python thread's stack to stderr even when the main thread is blocked in C++ holding the GIL
(where rank 0's Python watchdog thread cannot run). It is disarmed once the phases begin; the
phase watchdog (tp_watchdog) bounds them from there.
"""
from __future__ import annotations

import faulthandler
import json
import os
import sys
import time
from pathlib import Path

from pagedserve.runner.dist_env import PHASE_TIMEOUT_ENV, START_TIMEOUT_ENV, phase_timeout, start_timeout

STARTUP_DIR_ENV = "PAGEDSERVE_TP_STARTUP_DIR"
DEBUG_ENV = "PAGEDSERVE_TP_DEBUG"
# Same variable as tp_worker.FAIL_ENV: "RANK:SUB-STEP:hang" makes that rank stop at that sub-step.
FAIL_ENV = "PAGEDSERVE_TP_TEST_FAIL"
# Gloo and store waits give up this much after the bound: rank 0's watchdog diagnoses first, and a
# hang its Python thread cannot see (the main thread blocked in C++) still ends right after.
BACKSTOP_MARGIN_S = 1.0


def startup_bound() -> float:
    """Seconds any one pre-phase wait (and init_runner) may take: PAGEDSERVE_TP_START_TIMEOUT when it
    is set; unset, the smaller of its default (600) and PAGEDSERVE_TP_PHASE_TIMEOUT (default 900), so
    lowering only the phase bound lowers this too. Both set, each bounds its own part: e.g. a short
    bound for the phases and room for every rank's interpreter to start and import torch before them."""
    if os.environ.get(START_TIMEOUT_ENV):
        return start_timeout().total_seconds()
    return min(start_timeout().total_seconds(), phase_timeout())


def bound_names() -> str:
    return f"{START_TIMEOUT_ENV} / {PHASE_TIMEOUT_ENV}"


def startup_key(rank: int) -> str:
    return f"startup/{rank}"


class StartupTrace:
    """One rank's progress through the pre-phase sub-steps (see the module docstring)."""

    def __init__(self, rank: int, folder: str | None = None, t0: float | None = None):
        self.rank = rank
        self.folder = Path(folder) if folder else None
        self.t0 = time.monotonic() if t0 is None else t0
        self.store = None
        self.substep, self.since = "start", time.time()
        self.debug = debug_enabled()
        self._armed = False

    def attach_store(self, store) -> None:
        self.store = store
        self._publish()

    def step(self, substep: str, detail: str = "") -> None:
        """Enter `substep`: record it everywhere rank 0 looks, then (test hook) maybe hang there."""
        self.substep, self.since = substep, time.time()
        self._publish()
        if self.debug:
            debug_line(self.rank, time.monotonic() - self.t0, substep + (f" ({detail})" if detail else ""))
        _maybe_hang(self.rank, substep)

    def _publish(self) -> None:
        record = json.dumps({"substep": self.substep, "since": self.since, "pid": os.getpid()})
        if self.folder is not None:
            try:
                tmp = self.folder / f".rank{self.rank}.tmp"
                tmp.write_text(record)
                tmp.replace(self.folder / f"rank{self.rank}.json")
            except OSError:
                pass
        if self.store is not None:
            try:
                self.store.set(startup_key(self.rank), record)
            except Exception:  # rank 0 (the store's host) is gone: nobody is left to read it
                pass

    def arm_stack_dump(self) -> None:
        """Every thread's stack to stderr if this rank is still starting up startup_bound() s from now."""
        try:
            faulthandler.dump_traceback_later(startup_bound(), exit=False, file=_stderr())
            self._armed = True
        except (ValueError, OSError, RuntimeError):  # no usable stderr: the watchdog's dump remains
            pass

    def disarm_stack_dump(self) -> None:
        if self._armed:
            faulthandler.cancel_dump_traceback_later()
            self._armed = False


def debug_enabled() -> bool:
    return os.environ.get(DEBUG_ENV, "") not in ("", "0")


def debug_line(rank: int, elapsed_s: float, what: str) -> None:
    """One stderr line: wall clock (to line up the ranks), rank, seconds since its start, what."""
    print(f"pagedserve tp {time.strftime('%H:%M:%S')} rank {rank} +{elapsed_s:.1f}s: {what}",
          file=sys.stderr, flush=True)


def read_startup(rank: int, folder: str | None, store=None) -> dict | None:
    """Rank `rank`'s last recorded sub-step {substep, since, pid} (the store's, else the file's), or None."""
    if store is not None:
        try:
            if store.check([startup_key(rank)]):
                return json.loads(store.get(startup_key(rank)))
        except Exception:
            pass
    if folder:
        try:
            return json.loads((Path(folder) / f"rank{rank}.json").read_text())
        except (OSError, ValueError):
            pass
    return None


def describe_ranks(ranks, folder: str | None, store=None) -> str:
    """'rank 1 is at sub-step join store (for 12 s, pid 345)' for each rank, '; '-joined."""
    now, parts = time.time(), []
    for r in ranks:
        rec = read_startup(r, folder, store)
        if rec is None:
            parts.append(f"rank {r} has recorded no start-up sub-step (its interpreter has not started "
                         f"pagedserve.runner.launch)")
        else:
            parts.append(f"rank {r} is at sub-step {rec['substep']} (for {now - rec['since']:.0f} s, "
                         f"pid {rec['pid']})")
    return "; ".join(parts)


def _stderr():
    try:
        sys.stderr.fileno()
        return sys.stderr
    except (AttributeError, ValueError, OSError):  # replaced by a capture object without a file descriptor
        return sys.__stderr__


def _maybe_hang(rank: int, substep: str) -> None:
    fail = os.environ.get(FAIL_ENV, "").split(":")
    if len(fail) == 3 and fail[0] == str(rank) and fail[1] == substep and fail[2] == "hang":
        while True:
            time.sleep(1)
