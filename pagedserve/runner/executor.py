"""Executors: what the engine talks to instead of a ModelRunner.

Both expose the runner contract the engine uses — determine_num_blocks(...),
init_kv_cache(...), execute(plan, prev_sampled, sample) -> logits (or, given sample,
sample(logits)) — so the engine only chooses which one to build (build_executor). The
scheduler and KV manager exist once, on rank 0; the plan turns into compact tensors there
(runner.prepare_inputs) and those go to every rank, each of which holds a KV pool for its
own heads under the same block tables.

- UniProcExecutor (uniproc_executor.py): one ModelRunner in this process (tensor_parallel_size == 1).
- MultiProcExecutor: this process is rank 0 with its own ModelRunner; ranks 1..N-1 are
  processes spawned here (or, under torchrun's env:// variables, started externally).
  Every runner call is broadcast and executed on all ranks, so the collectives inside
  the model line up. A rank that dies fails the engine with that rank's number and cause
  (the watchdog, the worker monitor and the failure reports are its mixin, tp_failures.py).

Start-up runs as the same phases, in the same order, on every rank (tp_worker.STARTUP_PHASES):
load_model, determine_num_blocks (the profile; the minimum over ranks is the agreed block count),
then allocate_kv_cache, measure_swap_cost, capture_decode_graphs and warm_up (the engine's one
init_kv_cache call, split here into one command per phase). No wait is unbounded: a watchdog
fails the engine when a start-up phase outlives PAGEDSERVE_TP_PHASE_TIMEOUT or a step
PAGEDSERVE_TP_STEP_TIMEOUT, naming the phase and each rank's progress in it, and unblocks rank 0
(it kills spawned ranks, which fails gloo waits at once, and aborts the NCCL group).
"""
from __future__ import annotations

import atexit
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time

import torch
import torch.distributed as dist

from pagedserve.distributed import CollectiveError
from pagedserve.runner.dist_env import (DistEnv, free_port, is_external_worker, phase_timeout, step_timeout,
                                        torchrun_env)
from pagedserve.runner.dist_groups import (StartupError, compute_device, destroy_distributed, init_control,
                                           side_store)
from pagedserve.runner.launch import NUM_THREADS_ENV, PARENT_PID_ENV
from pagedserve.runner.tp_startup import (STARTUP_DIR_ENV, StartupTrace, debug_enabled, debug_line, describe_ranks,
                                          startup_bound)
from pagedserve.runner.tp_failures import FailureHandling, TensorParallelError, run_bounded
from pagedserve.runner.tp_watchdog import Watch, device_done_marker, dump_stacks
from pagedserve.runner.tp_worker import RETURNS_VALUE, SHUTDOWN, Command, Worker, _RemoteError, reply
from pagedserve.runner.uniproc_executor import UniProcExecutor

logger = logging.getLogger(__name__)


# How long shutdown waits for every rank to acknowledge before killing them.
SHUTDOWN_WAIT_S = 30.0
# How long a graceful teardown of the process groups may take before they are aborted instead.
TEARDOWN_WAIT_S = 15.0


def _min_over_ranks(results: list):
    """Capacities every rank can honour: the element-wise minimum (ints, or tuples of ints)."""
    first = results[0]
    if isinstance(first, (int, float)):
        return min(results)
    if isinstance(first, (tuple, list)) and all(isinstance(x, (int, float)) for x in first):
        return type(first)(min(col) for col in zip(*results))
    return first


class MultiProcExecutor(FailureHandling):
    """Rank 0 of a tensor-parallel group: broadcasts each call, runs its own share, returns its result."""

    # Per-rank answers that must agree (tp_worker.RETURNS_VALUE): rank 0 takes the minimum over ranks.
    REDUCE_MIN = RETURNS_VALUE

    def __init__(self, config, hf_config, device, dtype, runner_factory: str | None = None):
        self.world_size = config.tensor_parallel_size
        self._procs: dict[int, object] = {}
        self._failure: TensorParallelError | None = None
        self._dead: list[tuple[int, int | None]] = []
        self._closed = False
        self._lock = threading.Lock()
        self._saved_threads = torch.get_num_threads()
        self._seq = 0
        self._watch: Watch | None = None  # the call the watchdog is timing
        self._phase_timeout, self._step_timeout = phase_timeout(), step_timeout()
        self._t0 = time.monotonic()

        env = torchrun_env()
        if env is not None:
            if env.world_size != self.world_size:
                raise ValueError(f"tensor_parallel_size ({self.world_size}) must equal the launcher's "
                                 f"WORLD_SIZE ({env.world_size})")
            if env.rank != 0:
                raise RuntimeError(f"rank {env.rank} must run the worker loop, not an engine "
                                   "(see pagedserve.runner.launch)")
        else:
            env = DistEnv(rank=0, world_size=self.world_size, local_rank=0, master_addr="127.0.0.1",
                          master_port=free_port(), external=False)
        check_tp_shapes(hf_config, self.world_size, config.enable_expert_parallel)
        if config.device not in ("auto", "cpu", "cuda"):
            raise ValueError(f"device must be auto, cpu or cuda with tensor_parallel_size > 1 (rank r uses "
                             f"cuda:<LOCAL_RANK>; pick the GPUs with CUDA_VISIBLE_DEVICES), got {config.device!r}")
        if compute_device(env, config.device).type == "cuda" and not env.external:
            gpus = torch.cuda.device_count()
            if self.world_size > gpus:
                raise ValueError(f"tensor_parallel_size ({self.world_size}) must be <= the number of visible "
                                 f"GPUs ({gpus}); across machines, start the ranks with torchrun")
        self.env = env
        self._threads = 0
        if compute_device(env, config.device).type == "cpu" and not env.external:
            # The ranks share this host's cores; without this they oversubscribe them N-fold.
            self._threads = max(1, (os.cpu_count() or 1) // self.world_size)
            torch.set_num_threads(self._threads)
        atexit.register(self.shutdown)
        # Until the first start-up phase, every rank records its sub-step (tp_startup) and dumps its
        # stacks if still there after the bound; spawned ranks write theirs under this folder.
        self._startup_dir = None if env.external else tempfile.mkdtemp(prefix="pagedserve-tp-")
        self._trace = StartupTrace(0, self._startup_dir)
        self._trace.arm_stack_dump()
        try:
            self._start(env, config, hf_config, dtype, runner_factory)
        finally:
            self._trace.disarm_stack_dump()

    def _start(self, env, config, hf_config, dtype, runner_factory) -> None:
        """Everything before the first start-up phase: spawn, rendezvous, groups, runners."""
        if not env.external:
            self._trace.step("spawn", f"ranks 1..{self.world_size - 1}")
            self._spawn_workers()
            threading.Thread(target=self._monitor, daemon=True, name="tp-monitor").start()
        try:
            self.groups = init_control(env, self._trace, check_alive=self._raise_if_dead,
                                       describe=self._describe_startup)
        except StartupError as e:
            dump_stacks(self._procs.values())
            err = TensorParallelError(str(e))
            self._fail_with(err)
            raise err from e
        except BaseException:
            self._teardown(graceful=False)
            raise
        # The watchdog's and the error readers' own connection: the main thread's may be stuck in a wait.
        self._store = side_store(env)
        self.worker = Worker(self.groups, self._trace)
        threading.Thread(target=self._watchdog, daemon=True, name="tp-watchdog").start()
        # Each rank picks its own device (cuda:<local rank>, or the cpu); `device` names the kind.
        self.collective_rpc("init_runner", config, hf_config, dtype, runner_factory, want_result=True)
        self.runner = self.worker.runner

    def _describe_startup(self, ranks, store=None) -> str:
        """Where each of `ranks` is in the pre-phase start-up (their sub-step records)."""
        store = store if store is not None else getattr(self, "_store", None)
        return describe_ranks(ranks, self._startup_dir, store)

    # -- the runner contract -------------------------------------------------------------

    def execute(self, plan, prev_sampled=None, sample=None):
        """Run one step on every rank; returns rank 0's logits (already gathered over the vocab).

        An overlapped step passes prev_sampled (the previous step's sampled ids on rank 0's
        device) and sample (logits -> DeviceSample): rank 0 then samples inside the step and
        broadcasts the ids to the other ranks, which keep them for the next step's placeholders
        (sampled_ids.py says why this way), and this returns rank 0's DeviceSample. Nothing in
        the command depends on the previous step's results on the host."""
        step = self.runner.prepare_inputs(plan)
        step.share_sampled = sample is not None
        return self.collective_rpc("execute_model", step, local={"prev_sampled": prev_sampled, "sample": sample})

    def init_kv_cache(self, num_gpu_blocks: int, num_cpu_blocks: int) -> None:
        """The runner's init_kv_cache as four phases, each finished by every rank before the next."""
        self.collective_rpc("allocate_kv_cache", num_gpu_blocks, num_cpu_blocks, want_result=True)
        self.collective_rpc("measure_swap_cost", want_result=True)
        self.collective_rpc("capture_decode_graphs", want_result=True)
        self.collective_rpc("warm_up", want_result=True)

    def __getattr__(self, name):
        if name in ("runner", "worker", "groups"):
            raise AttributeError(name)
        value = getattr(self.runner, name)
        if not callable(value):
            return value

        def on_all_ranks(*args, **kwargs):
            # Set-up calls wait for every rank's answer, so a rank's error surfaces here, synchronously.
            return self.collective_rpc(name, *args, want_result=True, **kwargs)
        return on_all_ranks

    @property
    def worker_pids(self) -> dict[int, int]:
        return {r: p.pid for r, p in self._procs.items()}

    # -- broadcasting ----------------------------------------------------------------------

    def collective_rpc(self, method: str, *args, want_result: bool = False, local: dict | None = None, **kwargs):
        """Call Worker.<method> on every rank (rank 0 here) and return rank 0's result. local: keyword
        arguments for rank 0's own call only (tensors, callables), never sent.

        With want_result, wait for every rank's answer: an error there fails the engine naming
        the rank, and REDUCE_MIN results are combined. Steps do not wait (no extra round trip):
        a failing worker there reports through the store and the step's collectives fail.
        Either way the watchdog bounds the call (see _watchdog).
        """
        with self._lock:
            self._check_usable()
            self._seq += 1
            cmd = Command(method, args, kwargs, want_result, self._seq)
            step = method == "execute_model"
            bound = (self._step_timeout if step else startup_bound() if method == "init_runner"
                     else self._phase_timeout)
            watch = Watch(method, self._seq, time.monotonic() + bound)
            if not (step and self._watch is not None and not self._watch.finished()):
                self._watch = watch  # a step still running on the device keeps its own, earlier deadline
            try:
                _control(dist.broadcast_object_list, [cmd], src=0, group=self.groups.control)
                result = self.worker.dispatch(cmd, local)
                watch.own_done = True
                if not want_result:
                    watch.device_done = device_done_marker(self.groups.device)
                    return result
                gathered = [None] * self.world_size
                _control(dist.gather_object, reply(method, result), gathered, dst=0, group=self.groups.control)
                watch.device_done = lambda: True
            except BaseException as e:
                if self._failure is not None:  # the watchdog timed this call out and unblocked us
                    raise self._fail_with(self._failure) from e
                is_collective = isinstance(e, (CollectiveError, dist.DistError))
                found = self._describe_failures(wait_s=2.0 if is_collective else 0.0)
                if self._failure is None and time.monotonic() >= watch.deadline:
                    # Overran, then failed by its own (backstop) timeout while the watchdog, which polls,
                    # is about to diagnose it: its diagnosis names the ranks and sub-steps, so it wins.
                    deadline = time.monotonic() + 2.0
                    while self._failure is None and time.monotonic() < deadline:
                        time.sleep(0.05)
                if self._failure is not None:
                    raise self._fail_with(self._failure) from e
                if found:
                    raise self._fail_with(TensorParallelError("; ".join(found))) from e
                if is_collective:
                    alive = [r for r, p in self._procs.items() if p.poll() is None] or "unknown (external)"
                    raise self._fail_with(TensorParallelError(
                        f"tensor-parallel rank(s) {alive} stopped answering in {method} (no rank reported an "
                        f"error; PAGEDSERVE_TP_TIMEOUT bounds the wait): {e}")) from e
                # Rank 0's own error (a bad setting, no room for the KV cache, Ctrl-C, ...): the other
                # ranks may be stuck mid-step, so stop them, then let the original exception through.
                self._fail_with(TensorParallelError(f"tensor-parallel rank 0 failed in {method}: {e!r}"))
                raise
            for r in gathered:
                if isinstance(r, _RemoteError):
                    raise self._fail_with(TensorParallelError(
                        f"tensor-parallel rank {r.rank} failed in {method}: {r.summary}\n{r.traceback}"))
            return _min_over_ranks(gathered) if method in self.REDUCE_MIN else result

    # -- lifecycle -------------------------------------------------------------------------

    def _spawn_workers(self) -> None:
        """Start ranks 1..N-1 as `python -m pagedserve.runner.launch`: the same env:// path torchrun uses.

        A fresh interpreter (not multiprocessing's spawn) so the user's main script is never
        re-imported in the workers, guarded by `if __name__ == "__main__"` or not.
        """
        for rank in range(1, self.world_size):
            env = dict(os.environ, MASTER_ADDR=self.env.master_addr, MASTER_PORT=str(self.env.master_port),
                       WORLD_SIZE=str(self.world_size), RANK=str(rank), LOCAL_RANK=str(rank),
                       **{PARENT_PID_ENV: str(os.getpid())})
            if self._threads:
                env[NUM_THREADS_ENV] = str(self._threads)
            env["PYTHONPATH"] = _import_path()
            if self._startup_dir:
                env[STARTUP_DIR_ENV] = self._startup_dir
            self._procs[rank] = subprocess.Popen([sys.executable, "-m", "pagedserve.runner.launch"], env=env)

    def _kill_workers(self, grace_s: float = 0.0) -> None:
        deadline = time.monotonic() + grace_s
        for p in self._procs.values():
            try:
                p.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        for p in self._procs.values():
            if p.poll() is None:
                p.kill()
                p.wait(5.0)

    def _teardown(self, graceful: bool) -> None:
        if self._closed:
            return
        self._closed = True
        if graceful:
            # Every rank is past the shutdown barrier. Each first destroys its CUDA graphs: NCCL's
            # destroy (and abort) waits until no graph that captured one of its collectives is
            # left, which was the 2xH200 "TP=2 hang" (graph_capture.release_cuda_graphs). Then all
            # tear their groups down at the same time: rank 0 does not wait for the workers first.
            worker = getattr(self, "worker", None)
            if worker is not None:
                worker.release_cuda_graphs()
            self._debug("shutdown: destroy groups")
            destroy_distributed(wait_s=TEARDOWN_WAIT_S, abort_on_timeout=True, groups=getattr(self, "groups", None))
            self._debug("shutdown: reap workers")
            self._kill_workers(grace_s=10.0)
        else:
            self._kill_workers(grace_s=0.0)
            # This thread is not replaying a graph (the watchdog never tears down; it only aborts).
            # Released first, NCCL's abort can finish: CUDA destroys a graph still stuck in a
            # collective once the abort lets that kernel exit.
            # Bounded and without a device sync: a graph may be stuck in a collective until then.
            worker = getattr(self, "worker", None)
            if worker is not None:
                run_bounded(worker.release_cuda_graphs, 5.0, "tp-release-graphs", synchronize=False)
            self._abort_nccl()
            # After a failure a peer is gone, and NCCL's teardown can then block forever.
            destroy_distributed(wait_s=10.0, groups=getattr(self, "groups", None))
        self._debug("shutdown: done")
        self._store = None  # its connection closes now, while the store it talks to still exists
        torch.set_num_threads(self._saved_threads)
        if getattr(self, "_startup_dir", None):
            shutil.rmtree(self._startup_dir, ignore_errors=True)
        try:
            atexit.unregister(self.shutdown)
        except Exception:
            pass

    def _debug(self, what: str) -> None:
        if debug_enabled():
            debug_line(0, time.monotonic() - self._t0, what)

    def shutdown(self) -> None:
        """Tell every rank to exit, then reap them. Idempotent."""
        if self._closed:
            return
        self._debug("shutdown")
        graceful = False
        if self._failure is None and not self._dead and hasattr(self, "groups"):
            try:
                with self._lock:
                    # A rank that never reaches the barrier must not keep rank 0 here: the watchdog
                    # kills it after SHUTDOWN_WAIT_S, which fails the barrier.
                    watch = self._watch = Watch(SHUTDOWN, self._seq + 1, time.monotonic() + SHUTDOWN_WAIT_S)
                    dist.broadcast_object_list([Command(SHUTDOWN, seq=self._seq + 1)], src=0,
                                               group=self.groups.control)
                    dist.barrier(group=self.groups.control)  # every rank has it: see worker_loop
                    watch.device_done = lambda: True
                graceful = True
            except Exception as e:
                logger.warning("tensor-parallel shutdown broadcast failed: %s", e)
        self._teardown(graceful)


def _control(op, *args, **kwargs):
    """A control-group collective; its failure means a peer is gone, like a compute one's."""
    try:
        return op(*args, **kwargs)
    except RuntimeError as e:
        if isinstance(e, CollectiveError):
            raise
        raise CollectiveError(f"{op.__name__} over the control group failed: {e}") from e


def check_tp_shapes(hf_config, tp: int, expert_parallel: bool = False) -> None:
    """Refuse, before any process starts, a model whose heads or widths (or, with expert
    parallelism, experts) do not split into tp parts."""
    heads = hf_config.num_attention_heads
    kv = getattr(hf_config, "num_key_value_heads", None) or heads
    if heads % tp:
        raise ValueError(f"tensor_parallel_size ({tp}) must divide num_attention_heads ({heads})")
    if kv % tp and tp % kv:
        raise ValueError(f"tensor_parallel_size ({tp}) must divide num_key_value_heads ({kv}) or be a multiple "
                         "of it (KV heads are then replicated)")
    experts = getattr(hf_config, "num_local_experts", None) or getattr(hf_config, "num_experts", None)
    if expert_parallel and isinstance(experts, int) and experts % tp:
        raise ValueError(f"enable_expert_parallel: tensor_parallel_size ({tp}) must divide the number of "
                         f"experts ({experts})")
    expert_width = "intermediate_size" if getattr(hf_config, "model_type", "") == "mixtral" else "moe_intermediate_size"
    for key in ("intermediate_size", "ffn_dim", "moe_intermediate_size", "shared_expert_intermediate_size"):
        if expert_parallel and key == expert_width:
            continue  # whole experts per rank: their width is not split
        width = getattr(hf_config, key, None)
        if isinstance(width, int) and width % tp:
            raise ValueError(f"tensor_parallel_size ({tp}) must divide {key} ({width})")


def _import_path() -> str:
    """This process's sys.path minus the interpreter's own dirs: workers import what rank 0 imports."""
    own = tuple(os.path.realpath(p) for p in {sys.prefix, sys.base_prefix, sys.exec_prefix})
    keep = [os.path.abspath(p or os.getcwd()) for p in sys.path
            if not os.path.realpath(p or os.getcwd()).startswith(own)]
    return os.pathsep.join(dict.fromkeys(keep))


def build_executor(config, hf_config, device, dtype, runner_factory: str | None = None):
    """The executor for this engine: one process, or one process per tensor-parallel rank.

    Either way the result answers the ModelRunner's calls (load_model, determine_num_blocks,
    init_kv_cache, execute, profile, vocab_size, ...), so the engine never knows which it got.
    """
    if config.tensor_parallel_size == 1:
        return UniProcExecutor(config, hf_config, device, dtype, runner_factory)
    if is_external_worker():
        # A script started by torchrun on every rank: only rank 0 runs the engine, the others serve it.
        from pagedserve.runner.launch import main as worker_main
        raise SystemExit(worker_main())
    return MultiProcExecutor(config, hf_config, device, dtype, runner_factory)
