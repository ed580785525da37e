"""Process groups for tensor parallelism: one rendezvous, two groups.

Every rank joins the same TCPStore (hosted by rank 0) and two process groups:

- the control group (gloo, CPU, very long timeout) carries rank 0's commands and the
  small per-step plan. Workers sit in it between steps, so it must tolerate an idle
  server; a dead peer still fails it at once (gloo sees the socket close).
- the compute group (NCCL on GPUs, gloo on CPU) carries the model's all-reduces and
  all-gathers, with a bounded timeout, so a rank that hangs mid-step surfaces as an error.

The store doubles as the error channel: a worker that fails writes its traceback under
`error/<rank>` before exiting, and rank 0 reads it to name the rank and the cause.
"""
from __future__ import annotations

import gc
import json
import logging
import os
import threading
import time
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from pagedserve.runner.dist_env import CONTROL_TIMEOUT, DistEnv, compute_timeout

logger = logging.getLogger(__name__)


@dataclass
class DistGroups:
    env: DistEnv
    store: dist.Store
    control: object        # gloo ProcessGroup (the default group)
    compute: object = None  # NCCL or gloo ProcessGroup for the model's collectives (set by init_compute)
    device: torch.device | None = None


def compute_device(env: DistEnv, device: str) -> torch.device:
    """cuda:<local_rank> when this rank computes on a GPU, else cpu."""
    kind = device if device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    if kind.startswith("cuda"):
        return torch.device("cuda", env.local_rank)
    return torch.device(kind)


def joined_key(rank: int) -> str:
    return f"joined/{rank}"


def init_control(env: DistEnv, trace=None, check_alive=None, describe=None) -> DistGroups:
    """Join the rendezvous and the control group (blocks until every rank has arrived).

    Every wait here is bounded by tp_startup.startup_bound(). Rank 0 first waits for every rank's
    `joined` key in the store, calling check_alive() between polls, so a worker that dies while
    starting fails the start-up at once; a worker that is alive but never joins fails it at the
    bound, with describe(ranks) (where those ranks are) in the error. trace (a StartupTrace)
    records this rank's sub-steps: "join store", "control group".
    """
    from pagedserve.runner.tp_startup import BACKSTOP_MARGIN_S, bound_names, startup_bound
    if dist.is_initialized():
        raise RuntimeError("torch.distributed is already initialized in this process: "
                           "one tensor-parallel engine per process")
    step = trace.step if trace is not None else (lambda name, detail="": None)
    bound = startup_bound()
    # Store and gloo waits are the backstop: they give up a little after rank 0's own bound.
    backstop = timedelta(seconds=bound + BACKSTOP_MARGIN_S)
    step("join store", f"{env.master_addr}:{env.master_port}")
    # Under torchrun the agent of node 0 already hosts a store at MASTER_PORT: every rank is a client.
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    try:
        tcp = dist.TCPStore(env.master_addr, env.master_port, env.world_size,
                            is_master=env.rank == 0 and not agent_store, timeout=backstop, wait_for_workers=False)
    except Exception as e:
        raise StartupError(f"tensor-parallel rank {env.rank} could not join the store at {env.master_addr}:"
                           f"{env.master_port} (sub-step join store): {e}") from e
    store = dist.PrefixStore("pagedserve", tcp)  # the agent's store is shared with torchrun itself
    if trace is not None:
        trace.attach_store(store)
    if env.rank == 0:
        deadline = time.monotonic() + bound
        missing = list(range(1, env.world_size))
        while missing:
            if check_alive is not None:
                check_alive()
            missing = [r for r in missing if not store.check([joined_key(r)])]
            if missing and time.monotonic() > deadline:
                where = describe(missing, store) if describe is not None else ""
                raise StartupError(f"tensor-parallel start-up: rank(s) {missing} did not join the store at "
                                   f"{env.master_addr}:{env.master_port} within {bound:.0f} s ({bound_names()}); "
                                   f"rank 0 is at sub-step join store" + (f"; {where}" if where else ""))
            time.sleep(0.02)
    else:
        store.set(joined_key(env.rank), "1")
    step("control group")
    try:
        dist.init_process_group("gloo", store=store, rank=env.rank, world_size=env.world_size, timeout=backstop)
    except Exception as e:
        others = [r for r in range(env.world_size) if r != env.rank]
        where = describe(others, store) if describe is not None else ""
        raise StartupError(f"tensor-parallel rank {env.rank} could not build the control group within "
                           f"{backstop.total_seconds():.0f} s (sub-step control group)"
                           + (f"; {where}" if where else "") + f": {e}") from e
    # Idle workers wait in the control group for the next command: from now on, effectively forever.
    _set_timeout(dist.group.WORLD, CONTROL_TIMEOUT, required=True)
    return DistGroups(env=env, store=store, control=dist.group.WORLD)


def side_store(env: DistEnv, timeout_s: float = 10.0) -> dist.Store:
    """A second connection to the rendezvous store, for rank 0's watchdog threads.

    While the main thread waits in the store (a group's rendezvous waits there for a peer's address
    or NCCL id), another thread's check or get on the same client can queue behind that wait (seen
    with gloo's new_group), so a watchdog sharing it could not diagnose the hang it is there for.
    """
    tcp = dist.TCPStore(env.master_addr, env.master_port, None, is_master=False,
                        timeout=timedelta(seconds=timeout_s), wait_for_workers=False)
    return dist.PrefixStore("pagedserve", tcp)


class StartupError(RuntimeError):
    """A rank did not get through a pre-phase start-up sub-step within the bound."""


def _set_timeout(group, timeout: timedelta, required: bool = False) -> None:
    """required: the control group, created under the start-up bound, must not keep it (idle
    workers would then fail after the bound); the compute group's is a backstop to the watchdog."""
    try:
        from torch.distributed.distributed_c10d import _set_pg_timeout
        _set_pg_timeout(timeout, group)
    except Exception as e:  # private API
        if required:
            raise RuntimeError(f"could not lift the tensor-parallel control group's start-up timeout: {e}") from e
        logger.warning("could not set a tensor-parallel group's timeout: %s", e)


def init_compute(groups: DistGroups, device: str, trace=None) -> None:
    """Every rank, together: pick the device and build the compute group the model's collectives use."""
    from pagedserve.runner.tp_startup import BACKSTOP_MARGIN_S, startup_bound
    step = trace.step if trace is not None else (lambda name, detail="": None)
    dev = compute_device(groups.env, device)
    step("set device", str(dev))
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    backend = "nccl" if dev.type == "cuda" else "gloo"
    step("compute group", backend)
    # Creating the group waits for every rank to arrive here (gloo connects now; NCCL when
    # device_id is given); the phase watchdog bounds it, this timeout is the backstop. Only
    # then does the (shorter) per-collective bound apply.
    kwargs = {"device_id": dev} if dev.type == "cuda" else {}
    groups.compute = dist.new_group(list(range(groups.env.world_size)), backend=backend,
                                    timeout=timedelta(seconds=startup_bound() + BACKSTOP_MARGIN_S), **kwargs)
    _set_timeout(groups.compute, compute_timeout())
    groups.device = dev
    from pagedserve.distributed import init_tp_group
    init_tp_group(groups.env.rank, groups.env.world_size, groups.compute)


def abort_group(group) -> None:
    """Make every wait on `group` in this process fail now (best effort; NCCL honours it, gloo may not)."""
    try:
        from torch.distributed.distributed_c10d import _abort_process_group
        _abort_process_group(group)  # None: the default group, hence every group
    except Exception as e:  # experimental API: the group's own timeout remains the backstop
        logger.warning("could not abort a tensor-parallel process group: %s", e)


def destroy_distributed(wait_s: float | None = None, abort_on_timeout: bool = False,
                        groups: DistGroups | None = None) -> None:
    """Leave the groups and give this process back its single-rank TP group.

    With wait_s, the teardown runs on a helper thread and is abandoned after wait_s seconds:
    destroying an NCCL group whose peer died can block forever, and a failed engine must
    still return its error. abort_on_timeout then also aborts every group (NCCL's abort needs
    no peer), so nothing of this process stays blocked on them.

    groups: this process's DistGroups, whose ProcessGroup references are dropped once torch has
    let go of them. destroy_process_group alone leaves a group alive while Python holds it, and
    with it gloo's worker threads; one that finishes a work after the interpreter has begun to
    finalize needs the GIL to free the work's tensors and aborts the process ("terminate called
    without an active exception", seen under torchrun on a loaded machine). Freed here, the
    group joins its threads (torch drops the GIL in that destructor) while Python still runs.
    """
    from pagedserve.distributed import reset_tp_group
    reset_tp_group()
    if not dist.is_initialized():
        if groups is not None:
            groups.control = groups.compute = None
        return

    def destroy():
        try:
            dist.destroy_process_group()
        except Exception:  # a broken group (a peer died) may fail to tear down; it is gone either way
            pass
        if groups is not None:
            groups.control = groups.compute = None
            gc.collect()  # a reference cycle may still hold a group
    if wait_s is None:
        destroy()
        return
    t = threading.Thread(target=destroy, daemon=True, name="tp-destroy")
    t.start()
    t.join(wait_s)
    if t.is_alive():
        logger.warning("tensor-parallel process groups did not tear down within %.0f s; %s", wait_s,
                       "aborting them" if abort_on_timeout else "abandoning them")
        if abort_on_timeout:  # on a thread of its own too: NCCL's abort can block like its destroy
            a = threading.Thread(target=abort_group, args=(None,), daemon=True, name="tp-abort")
            a.start()
            a.join(5.0)


def error_key(rank: int) -> str:
    return f"error/{rank}"


def report_error(store: dist.Store, rank: int, message: str) -> None:
    """Leave this rank's failure where rank 0 will look for it; best effort (rank 0 may be gone)."""
    try:
        store.set(error_key(rank), message)
    except Exception:
        pass


def read_error(store: dist.Store, rank: int) -> str | None:
    try:
        if store.check([error_key(rank)]):
            return store.get(error_key(rank)).decode(errors="replace")
    except Exception:
        pass
    return None


# -- progress: what each rank is doing, for naming a stuck rank and its phase ------------------

def progress_key(rank: int) -> str:
    return f"progress/{rank}"


class Progress:
    """This rank's latest call (seq, method, running/done), published to the store.

    Set-up calls publish at once (they are few and slow); steps only update the fields, and a
    heartbeat thread publishes them every `interval` s, so the hot path never waits on the store.
    """

    def __init__(self, store: dist.Store, rank: int, interval: float = 0.25):
        self.store, self.rank, self.interval = store, rank, interval
        self.seq, self.method, self.state, self.since = 0, "start", "done", time.time()
        self._published = None
        self._lock = threading.Lock()
        self._stopped = threading.Event()

    def update(self, seq: int, method: str, state: str, publish: bool) -> None:
        self.seq, self.method, self.state, self.since = seq, method, state, time.time()
        if publish:
            self.publish()

    def publish(self) -> None:
        snapshot = (self.seq, self.method, self.state, self.since)
        with self._lock:
            if snapshot == self._published:
                return
            try:
                self.store.set(progress_key(self.rank), json.dumps(snapshot))
                self._published = snapshot
            except Exception:  # rank 0 (the store's host) is gone: nobody is left to read it
                pass

    def start_heartbeat(self) -> None:
        def beat():
            while not self._stopped.wait(self.interval):
                self.publish()
        threading.Thread(target=beat, daemon=True, name=f"tp-progress-{self.rank}").start()

    def stop(self) -> None:
        self._stopped.set()


def read_progress(store: dist.Store, rank: int) -> dict | None:
    """Rank `rank`'s last published progress: {seq, method, state, since}, or None."""
    try:
        if store.check([progress_key(rank)]):
            seq, method, state, since = json.loads(store.get(progress_key(rank)))
            return {"seq": seq, "method": method, "state": state, "since": since}
    except Exception:
        pass
    return None
