"""What rank 0 of a tensor-parallel group does when something goes wrong: the half of
MultiProcExecutor (runner/executor.py) that notices a stuck or dead rank and fails the engine
with a useful message instead of hanging.

- The watchdog thread times the call in flight (tp_watchdog.Watch) against
  PAGEDSERVE_TP_PHASE_TIMEOUT / PAGEDSERVE_TP_STEP_TIMEOUT; when it overruns it names the ranks
  and where each one is, dumps every rank's stacks, kills the spawned ranks and aborts NCCL, so the
  blocked main thread raises that diagnosis.
- The monitor thread notices a worker process that exits while the engine still needs it.
- The main thread turns a failed collective into the failing rank's own report (the store) or its
  exit code.

Everything here runs on the executor's own state; the mixin holds no state of its own.
"""
from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time

from pagedserve.runner.dist_groups import abort_group, read_error
from pagedserve.runner.tp_startup import startup_bound
from pagedserve.runner.tp_watchdog import diagnose, dump_stacks

# The executor's logger: these messages are the executor's, and log filters name it.
logger = logging.getLogger("pagedserve.runner.executor")


class TensorParallelError(RuntimeError):
    """A tensor-parallel rank failed or died; the engine cannot continue."""


class FailureHandling:
    """Mixin of MultiProcExecutor: the watchdog, the worker monitor and the failure reports."""

    # -- the watchdog ----------------------------------------------------------------------

    def _watchdog(self, poll_s: float = 0.2) -> None:
        """Fail the engine when the current call outlives its deadline, naming the phase and ranks.

        The main thread is then blocked in a collective (or in a device sync behind one), so it is
        unblocked from here: spawned ranks are killed (gloo sees their sockets close) and the
        compute group is aborted (NCCL); the main thread then raises this diagnosis.
        """
        while not self._closed:
            time.sleep(poll_s)
            watch = self._watch
            if watch is None or watch.finished() or self._failure is not None:
                continue
            if time.monotonic() < watch.deadline:
                continue
            bound = startup_bound() if watch.method == "init_runner" else self._phase_timeout
            what = diagnose(watch, self._store, self.world_size, bound, self._step_timeout)
            if watch.method == "init_runner":  # still before the phases: say which sub-step each rank is in
                what += "; " + self._describe_startup(range(self.world_size))
            err = TensorParallelError(what)
            logger.error("%s", err)
            self._failure = err  # first: the main thread may fail any moment now, and must raise this
            dump_stacks(self._procs.values())
            for p in self._procs.values():
                if p.poll() is None:
                    p.kill()
            self._abort_nccl()
            self._exit_if_still_blocked(err)
            return

    def _exit_if_still_blocked(self, err: TensorParallelError, grace_s: float = 60.0) -> None:
        """The last resort: ranks on other nodes cannot be killed from here, an aborted gloo group does
        not release a wait on it, and NCCL's abort is an experimental API. If a call (they all hold
        _lock) is still blocked grace_s after the diagnosis, end this process (torchrun then stops the
        other ranks) rather than hang."""
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline:
            if self._closed or not self._lock.locked():
                return
            time.sleep(0.2)
        print(f"pagedserve: {err}; rank 0 is still blocked {grace_s:.0f} s later: exiting", file=sys.stderr,
              flush=True)
        os._exit(1)

    def _abort_nccl(self, wait_s: float = 5.0) -> None:
        """NCCL waits for a dead or silent peer until its timeout: abort them. (Gloo waits fail
        as soon as the peer's process is gone.) On a thread of its own, waited for at most
        wait_s: NCCL's abort also waits for every CUDA graph that captured its collectives to
        be destroyed, which only the main thread can do (see graph_capture.release_cuda_graphs),
        and the caller must go on to its own bound either way."""
        groups = getattr(self, "groups", None)
        if (groups is not None and groups.compute is not None and groups.device is not None
                and groups.device.type == "cuda"):
            run_bounded(abort_group, wait_s, "tp-abort", groups.compute)

    # -- failure handling ------------------------------------------------------------------

    def _check_usable(self) -> None:
        if self._failure is not None:
            raise self._failure
        if self._closed:
            raise TensorParallelError("the tensor-parallel executor is shut down")
        if self._dead:
            raise self._fail()

    def _monitor(self) -> None:
        """Notice a worker process that exits while the engine still needs it.

        On CPU the next collective fails at once (gloo sees the socket close) and the main
        thread raises. NCCL instead waits for a dead peer until its timeout, so there the
        compute group is aborted, which turns the wait into an error the main thread raises.
        """
        pending = dict(self._procs)
        while pending and not self._closed:
            for rank, p in list(pending.items()):
                code = p.poll()
                if code is not None and not self._closed:
                    del pending[rank]
                    self._dead.append((rank, code))
                    logger.error("tensor-parallel rank %d (pid %d) exited with code %s", rank, p.pid, code)
                    self._abort_compute_if_stuck()
            time.sleep(0.1)

    def _abort_compute_if_stuck(self, grace_s: float = 2.0) -> None:
        groups = getattr(self, "groups", None)
        if groups is None or groups.device is None or groups.device.type != "cuda":
            return
        time.sleep(grace_s)
        if self._failure is None and not self._closed:
            self._abort_nccl()

    def _raise_if_dead(self) -> None:
        for rank, p in self._procs.items():
            code = p.poll()
            if code is not None:
                self._teardown(graceful=False)
                raise TensorParallelError(f"tensor-parallel rank {rank} (pid {p.pid}) exited with code "
                                          f"{code}{_signal_name(code)} while starting")

    def _describe_failures(self, wait_s: float) -> list[str]:
        """Which ranks failed and why, waiting briefly for a failing rank's report or exit."""
        deadline = time.monotonic() + wait_s
        while True:
            found = []
            for rank in range(1, self.world_size):
                msg = read_error(getattr(self, "_store", None) or self.groups.store, rank)
                proc = self._procs.get(rank)
                code = proc.poll() if proc is not None else None
                if msg is not None:
                    found.append(f"tensor-parallel rank {rank} failed: {msg.strip()}")
                elif code is not None:
                    found.append(f"tensor-parallel rank {rank} (pid {proc.pid}) died with exit code "
                                 f"{code}{_signal_name(code)}")
            if found or time.monotonic() >= deadline:
                return found
            time.sleep(0.05)

    def _fail(self) -> TensorParallelError:
        """A worker is known to be dead: name it and its cause."""
        found = self._describe_failures(wait_s=0.5) or [f"tensor-parallel rank {r} exited with code {c}"
                                                        for r, c in self._dead]
        return self._fail_with(TensorParallelError("; ".join(found)))

    def _fail_with(self, err: TensorParallelError) -> TensorParallelError:
        logger.error("%s", err)
        self._failure = err
        self._teardown(graceful=False)
        return err


def _signal_name(code: int | None) -> str:
    if code is not None and code < 0:
        try:
            return f" ({signal.Signals(-code).name})"
        except ValueError:
            pass
    return ""


def run_bounded(fn, wait_s: float, name: str, *args, **kwargs) -> bool:
    """fn(*args, **kwargs) on a daemon thread, waited for at most wait_s; whether it finished."""
    t = threading.Thread(target=fn, args=args, kwargs=kwargs, daemon=True, name=name)
    t.start()
    t.join(wait_s)
    return not t.is_alive()
