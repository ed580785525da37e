"""What rank 0's watchdog needs to fail a stuck tensor-parallel engine with a useful message.

The executor times each call (a Watch): a start-up phase against PAGEDSERVE_TP_PHASE_TIMEOUT,
a step against PAGEDSERVE_TP_STEP_TIMEOUT. A call is finished when rank 0 has its answer and,
on CUDA, its queued device work has completed (a step's collectives run asynchronously, so a
step whose peer never joins is still pending after execute_model returns). When one overruns,
diagnose() says which ranks are stuck where, from the progress every rank publishes to the
store (dist_groups.Progress), and dump_stacks() puts every rank's Python stacks on stderr.
"""
from __future__ import annotations

import signal
import sys
import threading
import time
import traceback

import torch

from pagedserve.runner.dist_env import PHASE_TIMEOUT_ENV, STEP_TIMEOUT_ENV
from pagedserve.runner.dist_groups import read_progress
from pagedserve.runner.tp_worker import STARTUP_PHASES


class Watch:
    """One call the watchdog times."""

    def __init__(self, method: str, seq: int, deadline: float):
        self.method, self.seq, self.deadline = method, seq, deadline
        self.own_done = False    # rank 0 has run its own share
        self.device_done = None  # () -> bool, set once rank 0 has issued its share (and has the answers)

    def finished(self) -> bool:
        return self.device_done is not None and self.device_done()


def device_done_marker(device: torch.device | None):
    """() -> bool: has the device finished what was queued until now?"""
    if device is None or device.type != "cuda":
        return lambda: True
    event = torch.cuda.Event()
    event.record()
    return event.query


def diagnose(watch: Watch, store, world_size: int, phase_timeout: float, step_timeout: float) -> str:
    """Which call overran, which ranks are stuck in it, and what each rank last reported."""
    if watch.method == "execute_model":
        what = f"step (execute_model #{watch.seq}) did not finish within {step_timeout:.0f} s ({STEP_TIMEOUT_ENV})"
    elif watch.method in ("init_runner",) + STARTUP_PHASES:
        what = f"start-up phase {watch.method} did not finish within {phase_timeout:.0f} s ({PHASE_TIMEOUT_ENV})"
    else:
        what = f"call {watch.method} did not finish in time"
    if watch.own_done:
        ranks = ["rank 0 finished its share" + (", its device work has not completed"
                                                if watch.method == "execute_model" else " and waits for the others")]
    else:
        ranks = [f"rank 0 is still in {watch.method} (in a collective, if another rank is stuck)"]
    now, stuck = time.time(), []
    for r in range(1, world_size):
        p = read_progress(store, r)
        if p is None:
            ranks.append(f"rank {r} has reported no progress")
            stuck.append(r)
        elif p["seq"] < watch.seq:
            ranks.append(f"rank {r} never started {watch.method}: its last call was {p['method']} "
                         f"({p['state']} {now - p['since']:.0f} s ago)")
            stuck.append(r)
        elif p["seq"] == watch.seq and p["state"] != "done":
            ranks.append(f"rank {r} is stuck in {watch.method} ({p['state']} for {now - p['since']:.0f} s)")
            stuck.append(r)
        else:
            ranks.append(f"rank {r} finished {watch.method}")
    if not stuck and not watch.own_done:
        stuck = [0]  # every other rank is past it: rank 0 itself is the one stuck
    who = f"rank(s) {stuck}" if stuck else "no rank (all report done; a collective never completed)"
    return f"tensor-parallel {what}; stuck: {who} in {watch.method}. " + "; ".join(ranks)


def dump_stacks(procs, wait_s: float = 1.0) -> None:
    """Every rank's Python stacks to stderr: spawned ranks dump theirs on SIGUSR1 (see launch)."""
    for p in procs:
        if p.poll() is None:
            try:
                p.send_signal(signal.SIGUSR1)
            except OSError:
                pass
    names = {t.ident: t.name for t in threading.enumerate()}
    stacks = [f"thread {names.get(ident, ident)}:\n" + "".join(traceback.format_stack(frame))
              for ident, frame in sys._current_frames().items()]
    print("tensor-parallel rank 0 stacks:\n" + "\n".join(stacks), file=sys.stderr, flush=True)
    time.sleep(wait_s)  # the ranks write theirs before they are killed
