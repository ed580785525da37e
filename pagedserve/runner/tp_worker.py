"""A tensor-parallel rank: its own ModelRunner (its shard of the weights and KV heads) and,
for ranks > 0, the loop that executes rank 0's commands.

Rank 0 broadcasts one command at a time over the control group: (method, args, kwargs,
want_result). Every rank, rank 0 included, calls the same Worker method with the same
arguments, so the model's collectives line up. Results come back to rank 0 only when
asked (gather_object); a step's logits never do, rank 0 has its own copy. An overlapped step
ends with rank 0 sampling and broadcasting the sampled ids, which the next step's placeholders
read on every rank (sampled_ids.py).

Start-up is a fixed sequence of phases, each one command run by every rank in the same
order (STARTUP_PHASES): load_model, determine_num_blocks (the profile: the same forward,
hence the same collectives, on every rank; rank 0 takes the minimum block count),
allocate_kv_cache, measure_swap_cost, capture_decode_graphs, warm_up. Every rank publishes which
command it is in (dist_groups.Progress), so rank 0 can name a rank stuck in a phase.

A worker that fails writes its traceback into the store under its rank and exits; a
worker whose rank 0 is gone exits too (the control group fails, and spawned workers also
watch their parent's pid), so nothing is left behind.
"""
from __future__ import annotations

import logging
import os
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field

import torch.distributed as dist

from pagedserve.runner.dist_env import DistEnv
from pagedserve.runner.dist_groups import (DistGroups, Progress, destroy_distributed, init_compute, init_control,
                                           report_error)
from pagedserve.runner.sampled_ids import SampledIdRelay
from pagedserve.runner.tp_startup import FAIL_ENV, StartupTrace, debug_enabled, debug_line

logger = logging.getLogger(__name__)

SHUTDOWN = "shutdown"
# Calls whose worker results rank 0 needs; every other call only acknowledges (or reports an error).
RETURNS_VALUE = ("determine_num_blocks",)
DEFAULT_RUNNER = "pagedserve.runner.model_runner:ModelRunner"
# The start-up phases, in order; every rank runs each one (init_runner comes first).
STARTUP_PHASES = ("load_model", "determine_num_blocks", "allocate_kv_cache", "measure_swap_cost",
                  "capture_decode_graphs", "warm_up")
# Test hook: "RANK:CALL" makes that rank raise on its CALL-th execute_model (1-based), or, when
# CALL is a method name (a start-up phase), on that call; "RANK:CALL:hang" makes it stop
# answering there instead.
# A pre-phase sub-step in place of CALL ("1:compute group:hang") makes the rank stop there (tp_startup).


@dataclass
class Command:
    method: str
    args: tuple = ()
    kwargs: dict = field(default_factory=dict)
    want_result: bool = False
    seq: int = 0  # rank 0's running count of commands, so a rank's progress says which call it is in


class InjectedFailure(RuntimeError):
    pass


class Worker:
    """The per-rank half of the executor: everything a rank does, called identically on every rank."""

    def __init__(self, groups: DistGroups, trace: StartupTrace | None = None):
        self.groups = groups
        self.trace = trace
        self._debug = debug_enabled()
        self._t0 = trace.t0 if trace is not None else time.monotonic()  # debug lines: seconds since start
        self.rank = groups.env.rank
        self.runner = None
        self._executes = 0
        self.sampled_ids = SampledIdRelay(self.rank)
        self.progress = Progress(groups.store, self.rank)
        fail = os.environ.get(FAIL_ENV, "").split(":")
        self._fail_at, self._fail_method, self._fail_hang = None, None, False
        if len(fail) >= 2 and fail[0].isdigit() and int(fail[0]) == self.rank:
            if fail[1].isdigit():
                self._fail_at = int(fail[1])
            else:
                self._fail_method = fail[1]
            self._fail_hang = fail[2:] == ["hang"]

    def init_runner(self, config, hf_config, dtype, runner_factory: str | None = None) -> None:
        """Build the compute group and this rank's ModelRunner (load_model then reads only its slices)."""
        init_compute(self.groups, config.device, self.trace)
        if self.trace is not None:
            self.trace.step("fast all-reduce")
        from pagedserve.distributed import get_tp_group
        from pagedserve.runner.symm_allreduce import install
        get_tp_group().fast_all_reduce = install(self.groups.compute, self.rank, self.groups.env.world_size,
                                                 self.groups.device, dtype)
        if self.trace is not None:
            self.trace.step("build runner")
        factory = _resolve(runner_factory or DEFAULT_RUNNER)
        self.runner = factory(config, hf_config, self.groups.device, dtype)

    def call(self, method: str, *args, **kwargs):
        """Any other method of the runner (determine_num_blocks, init_kv_cache, ...)."""
        return getattr(self.runner, method)(*args, **kwargs)

    def release_cuda_graphs(self, synchronize: bool = True) -> None:
        """Before the groups are destroyed (graph_capture.release_cuda_graphs says why)."""
        runner = getattr(self, "runner", None)
        if runner is not None and hasattr(runner, "release_cuda_graphs"):
            runner.release_cuda_graphs(synchronize=synchronize)

    def execute_model(self, model_input, prev_sampled=None, sample=None):
        """One step. prev_sampled and sample are rank 0's own (never sent): the previous step's
        sampled ids on its device, and the engine's sampler for a step that shares its ids
        (model_input.share_sampled); then this returns rank 0's DeviceSample, not logits. The
        other ranks read their placeholders from the ids the previous step shared."""
        self._executes += 1
        if self._fail_at is not None and self._executes == self._fail_at:
            self._injected_failure(f"execute #{self._executes}")
        received = self.sampled_ids.take()
        if self.rank != 0:
            prev_sampled = received
        logits = self.runner.execute_model(model_input, prev_sampled)
        if not model_input.share_sampled:
            return logits
        if logits is None or logits.shape[0] == 0:
            return None  # nothing sampled, nothing to share: the same on every rank (same step input)
        return self.sampled_ids.share(logits, sample)

    def _injected_failure(self, where: str) -> None:
        while self._fail_hang:
            time.sleep(1)
        raise InjectedFailure(f"injected failure on rank {self.rank} at {where}")

    def dispatch(self, cmd: Command, local: dict | None = None):
        """Run one command, keeping this rank's published progress current. local: keyword
        arguments only this rank's call gets (rank 0's tensors and callables, never pickled)."""
        step = cmd.method == "execute_model"
        if self.trace is not None and cmd.method in STARTUP_PHASES:
            # The phases have begun: the phase watchdog bounds them from here.
            self.trace.step("phases", cmd.method)
            self.trace.disarm_stack_dump()
            self.trace = None
        self.progress.update(cmd.seq, cmd.method, "running", publish=not step)
        t0 = time.monotonic()
        if self._debug and not step:
            debug_line(self.rank, t0 - self._t0, f"{cmd.method} started")
        if cmd.method == self._fail_method:
            self._injected_failure(cmd.method)
        kwargs = {**cmd.kwargs, **local} if local else cmd.kwargs
        if cmd.method in ("init_runner", "execute_model"):
            result = getattr(self, cmd.method)(*cmd.args, **kwargs)
        else:
            result = self.call(cmd.method, *cmd.args, **kwargs)
        self.progress.update(cmd.seq, cmd.method, "done", publish=not step)
        if self._debug and not step:
            debug_line(self.rank, time.monotonic() - self._t0, f"{cmd.method} done in {time.monotonic() - t0:.1f} s")
        return result


def _resolve(path: str):
    """"module:attr" -> the object (so a runner class can be named across processes)."""
    import importlib
    mod, _, name = path.partition(":")
    return getattr(importlib.import_module(mod), name)


def recv_command(groups: DistGroups) -> Command:
    box = [None]
    dist.broadcast_object_list(box, src=0, group=groups.control)
    return box[0]


def worker_loop(worker: Worker) -> None:
    """Serve rank 0 until it says shutdown; raises whatever a command raised."""
    groups = worker.groups
    while True:
        cmd = recv_command(groups)
        if cmd.method == SHUTDOWN:
            # Rank 0 waits here too: no send is still in flight when either side tears its
            # groups down (gloo can abort a process whose pair is destroyed mid-send).
            dist.barrier(group=groups.control)
            worker.release_cuda_graphs()
            if worker._debug:
                debug_line(worker.rank, time.monotonic() - worker._t0, "shutdown: destroy groups")
            return
        try:
            result = worker.dispatch(cmd)
        except Exception as e:
            worker.progress.update(cmd.seq, cmd.method, "failed", publish=True)
            if not cmd.want_result:
                raise
            # Rank 0 is waiting in gather_object: hand the error back there instead of dying.
            result = _RemoteError(worker.rank, f"{type(e).__name__}: {e}", traceback.format_exc())
        if cmd.want_result:
            if not isinstance(result, _RemoteError):
                result = reply(cmd.method, result)
            dist.gather_object(result, None, dst=0, group=groups.control)


def reply(method: str, result):
    """What a rank sends back for a set-up call: its value for RETURNS_VALUE calls, else a bare
    acknowledgement (load_model's nn.Module must never be pickled through the control group)."""
    return result if method in RETURNS_VALUE else None


@dataclass
class _RemoteError:
    rank: int
    summary: str
    traceback: str


def _watch_parent(ppid: int) -> None:
    """Exit when the spawning process is gone (it may have been SIGKILLed and never said shutdown)."""
    while True:
        if os.getppid() != ppid:
            os._exit(3)
        time.sleep(0.5)


def run_worker(env: DistEnv, parent_pid: int | None = None, trace: StartupTrace | None = None) -> int:
    """Serve rank 0 as rank env.rank > 0 until it shuts down; returns the process exit code."""
    if parent_pid is not None:
        threading.Thread(target=_watch_parent, args=(parent_pid,), daemon=True, name="parent-watch").start()
    groups = None
    ok = False
    try:
        trace = trace or StartupTrace(env.rank)
        groups = init_control(env, trace)
        trace.step("wait for init_runner")
        worker = Worker(groups, trace)
        worker.progress.start_heartbeat()
        worker_loop(worker)
        ok = True
        return 0
    except BaseException as e:
        msg = f"{type(e).__name__}: {e}\n{traceback.format_exc()}"
        if groups is not None:
            report_error(groups.store, env.rank, msg)
        print(f"pagedserve tensor-parallel rank {env.rank} failed: {msg}", file=sys.stderr, flush=True)
        return 1
    finally:
        # After a failure a peer may be gone, and NCCL's teardown can then block forever.
        # Rank 0 tears its groups down at the same time (executor._teardown); bounded either way.
        destroy_distributed(wait_s=15.0 if ok else 10.0, abort_on_timeout=ok, groups=groups)
