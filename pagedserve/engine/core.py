"""EngineCore: the LLMEngine (scheduler + KV manager + runner) and, in its own process, the busy loop.

One loop iteration: take every queued input (adds, aborts, utility calls, in the order the
client sent them) -> run one engine step if any request is unfinished -> send ONE StepOutputs
(utility answers leave in a message of their own before the step, so they never wait for it).
With nothing to run the loop blocks on the input socket; it never spins.

The process (`run_engine_core`, or `python -m pagedserve.engine.core`) loads the model, sizes
the KV cache and captures graphs, then sends Ready on its output socket; a start-up error is
sent as StartupFailed and the process exits non-zero. A watchdog thread exits the process
within a second once its parent (the API server) is gone, so a SIGKILLed server never leaves
an engine holding the GPU.
"""
from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import signal
import sys
import threading
import time
import traceback
from typing import Any, Callable

import msgspec

from pagedserve.config import EngineConfig
from pagedserve.engine.core_messages import (AbortRequests, AddBeamSearch, AddRequest, Codec, CompletionDelta,
                                             CoreInputs, Ready, RequestDelta, Shutdown,
                                             StartupFailed, StepOutputs, UtilityCall, UtilityResult)
from pagedserve.engine.pauses import freeze_startup_heap, install_gc_pause_log, pause_threshold_s
from pagedserve.engine.step_trace import STEP_TRACE_ENV, StepTrace, step_trace_from_env
from pagedserve.metrics import EngineSnapshot
from pagedserve.outputs import RequestOutput

logger = logging.getLogger("pagedserve.engine_core")

PARENT_POLL_S = 0.5


def utility(fn: Callable) -> Callable:
    """Marks an EngineCore method as callable through call_utility (its result must be
    msgspec-encodable: builtins, dataclasses, Structs). Adding a call is this decorator."""
    fn.is_core_utility = True
    return fn


class StepFailed(RuntimeError):
    """LLMEngine.step raised; request_ids were in flight and have been aborted."""

    def __init__(self, request_ids: list[str], cause: BaseException) -> None:
        super().__init__(f"engine step failed: {cause!r}")
        self.request_ids = request_ids


class EngineCore:
    """Owns one LLMEngine. Not thread-safe: one loop (or one in-process client) drives it."""

    def __init__(self, config: EngineConfig | None, engine: Any | None = None,
                 detokenize: bool = True, serving: bool = False, specs_checked: bool = False) -> None:
        """specs_checked: the API server is in front (LLMEngine's specs_checked)."""
        if engine is None:
            from pagedserve.engine.llm_engine import LLMEngine
            engine = LLMEngine(config, detokenize=detokenize, serving=serving, specs_checked=specs_checked)
        self.engine = engine
        # Requests the engine holds (added, not yet finished or aborted): a failed step fails these.
        self._live: set[str] = set()

    # ---- inputs ---------------------------------------------------------------------------

    def add_request(self, request_id: str, prompt: Any, params: Any,
                    arrival_time: float | None = None, priority: int = 0) -> None:
        """LLMEngine.add_request; raises its ValueError for bad input."""
        self.engine.add_request(request_id, prompt, params, arrival_time=arrival_time, priority=priority)
        self._live.add(request_id)

    def add_beam_search_request(self, request_id: str, prompt: Any, params: Any,
                                arrival_time: float | None = None, priority: int = 0) -> None:
        """LLMEngine.add_beam_search_request; its result leaves with the step that ends it."""
        self.engine.add_beam_search_request(request_id, prompt, params, arrival_time=arrival_time,
                                            priority=priority, emit_output=True)
        self._live.add(request_id)

    def abort_requests(self, request_ids: list[str]) -> None:
        self.engine.abort_request(request_ids)
        self._live.difference_update(request_ids)

    def call_utility(self, method: str, args: list[Any]) -> Any:
        fn = getattr(self, method, None)
        if not getattr(fn, "is_core_utility", False):
            raise ValueError(f"method must be an engine-core utility, got {method!r}")
        return fn(*args)

    @utility
    def get_kv_cache_state(self) -> dict:
        return self.engine.get_kv_cache_state()

    @utility
    def get_kv_cache_stats(self, token_counts: bool = True) -> dict:
        return dataclasses.asdict(self.engine.get_kv_cache_stats(token_counts))

    @utility
    def get_spec_decode_stats(self) -> dict | None:
        stats = self.engine.get_spec_decode_stats()
        return None if stats is None else dataclasses.asdict(stats)

    # ---- the step -------------------------------------------------------------------------

    def step(self, final_only: bool = False) -> list[RequestOutput]:
        """One engine step. If the step raises, every live request is aborted (its blocks
        freed) and StepFailed names them: the caller fails them, the core lives on."""
        try:
            outs = self.engine.step(final_only=final_only)
        except Exception as e:
            failed = sorted(self._live)
            self._live.clear()
            try:
                self.engine.abort_request(failed)
            except Exception:
                logger.exception("could not abort the requests of a failed step")
            raise StepFailed(failed, e) from e
        for out in outs:
            if out.finished:
                self._live.discard(out.request_id)
        return outs

    def has_unfinished_requests(self) -> bool:
        return self.engine.has_unfinished_requests()

    def snapshot(self) -> EngineSnapshot:
        # O(1): no live-token count, which would walk every block table.
        stats = self.engine.get_kv_cache_stats(token_counts=False)
        sched = self.engine.scheduler
        # The step of this iteration, counted once: the next snapshot without a step says 0.
        tokens, self.engine.last_step_tokens = getattr(self.engine, "last_step_tokens", 0), 0
        return EngineSnapshot(num_running=sched.num_running, num_waiting=sched.num_waiting,
                              iteration_tokens=tokens,
                              num_swapped=sched.num_swapped, kv_cache_usage=stats.usage,
                              prefix_cache_hit_rate=stats.prefix_cache_hit_rate,
                              num_preemptions=stats.num_preemptions,
                              prefix_cache_queries=stats.prefix_cache_queries,
                              prefix_cache_hits=stats.prefix_cache_hits, cache_dtype=stats.cache_dtype,
                              num_gpu_blocks=stats.num_blocks_total, block_size=stats.block_size,
                              **self._structured_stats(), **self._spec_decode_stats())

    def _spec_decode_stats(self) -> dict:
        """Speculative decoding's counters (spec_decode/stats.py) for /metrics; none without it."""
        spec = getattr(self.engine, "speculator", None)
        if spec is None:
            return {}
        st = spec.stats
        return dict(spec_decode_enabled=True, spec_decode_num_drafts=st.num_drafts,
                    spec_decode_num_draft_tokens=st.num_draft_tokens,
                    spec_decode_num_accepted_tokens=st.num_accepted_tokens,
                    spec_decode_num_accepted_tokens_per_pos=list(st.num_accepted_tokens_per_pos),
                    spec_decode_proposer_seconds=st.proposer_seconds,
                    spec_decode_num_paused_steps=st.num_paused_steps,
                    spec_decode_num_unproposed_steps=st.num_unproposed_steps,
                    spec_decode_num_shadow_probes=st.num_shadow_probes)

    def _structured_stats(self) -> dict:
        """The grammar compile counters (engine/structured/), for /metrics; none before the first."""
        structured = getattr(self.engine, "structured", None)
        pool = None if structured is None else structured.pool_if_started
        if pool is None:
            return {}
        st = pool.stats
        return dict(structured_output_compiles=st.compiles, structured_output_cache_hits=st.cache_hits,
                    structured_output_compile_seconds_sum=st.seconds_sum,
                    structured_output_compile_seconds_buckets=list(st.bucket_counts))

    def describe(self) -> str:
        """The start-up line a user reads: what runs where, and how much KV cache it got."""
        e = self.engine
        cc = e.cache_config
        device = getattr(e, "device", None)
        dtype = str(getattr(e, "dtype", "")).replace("torch.", "")
        return (f"engine ready: {e.config.model} on {device} ({dtype}), max_model_len {e.max_model_len}, "
                f"KV cache {cc.num_gpu_blocks} blocks of {cc.block_size} tokens "
                f"({cc.num_gpu_blocks * cc.block_size} tokens), up to {e.scheduler_config.max_num_seqs} sequences a step")

    def ready_message(self) -> Ready:
        e = self.engine
        cc = e.cache_config
        return Ready(pid=os.getpid(), max_model_len=int(e.max_model_len), vocab_size=int(e.vocab_size),
                     num_gpu_blocks=int(cc.num_gpu_blocks), num_cpu_blocks=int(cc.num_cpu_blocks),
                     block_size=int(cc.block_size), max_num_seqs=int(e.scheduler_config.max_num_seqs),
                     eos_token_ids=sorted(e.eos_token_ids),
                     max_logprobs=int(e.max_logprobs))

    def shutdown(self) -> None:
        self.engine.shutdown()

    # ---- one iteration of the process's loop ----------------------------------------------

    def handle_inputs(self, inputs: CoreInputs, out: StepOutputs) -> bool:
        """Apply the ops in order, recording their results in `out`; False on Shutdown."""
        for op in inputs.ops:
            if isinstance(op, (AddRequest, AddBeamSearch)):
                add = self.add_request if isinstance(op, AddRequest) else self.add_beam_search_request
                try:
                    add(op.request_id, {"prompt_token_ids": op.prompt_token_ids, "prompt": op.prompt,
                                        "cache_salt": op.cache_salt},
                        op.params, op.arrival_time, op.priority)
                    out.added.append(op.request_id)
                except ValueError as e:
                    out.rejected.append((op.request_id, str(e)))
            elif isinstance(op, AbortRequests):
                try:
                    self.abort_requests(op.request_ids)
                except Exception:
                    logger.exception("abort of %s failed", op.request_ids)
            elif isinstance(op, UtilityCall):
                try:
                    result = msgspec.to_builtins(self.call_utility(op.method, op.args))
                    out.utility_results.append(UtilityResult(op.call_id, result))
                except Exception as e:
                    out.utility_results.append(UtilityResult(op.call_id, error=f"{type(e).__name__}: {e}"))
            elif isinstance(op, Shutdown):
                return False
        return True

    def step_outputs(self, out: StepOutputs) -> None:
        """Run one step into `out` (a failed step fails the requests it held, the core lives on)."""
        try:
            outs = self.step()
        except StepFailed as e:
            logger.exception("engine step failed; failing the requests in flight")
            out.failed = e.request_ids
            out.step_error = str(e)
            return
        out.outputs = [RequestDelta(o.request_id, [CompletionDelta.of(c) for c in o.outputs],
                                    o.finished, o.metrics if o.finished else None, o.error, o.prompt_logprobs)
                       for o in outs]

    def run_busy_loop(self, input_socket: Any, output_socket: Any) -> None:
        """Serve until a Shutdown arrives. Blocks on input_socket while idle."""
        import zmq
        codec = Codec()
        decode, encode = codec.inputs.decode, codec.encode
        slow_s = pause_threshold_s()
        trace = getattr(self.engine, "step_timer", None)
        trace = trace if isinstance(trace, StepTrace) else None
        running = True
        while running:
            busy = self.engine.has_unfinished_requests()
            if trace is not None and not busy:
                trace.flush(idle=True)  # the device is idle: every event is complete
            frames = [] if busy else [input_socket.recv(copy=False)]
            while True:
                try:
                    frames.append(input_socket.recv(zmq.NOBLOCK, copy=False))
                except zmq.Again:
                    break
            t0 = time.perf_counter()  # after any idle wait: only the work counts as a pause
            out = StepOutputs()
            for frame in frames:
                try:
                    inputs = decode(frame.buffer)
                except msgspec.MsgspecError:  # a client bug must not take every request down
                    logger.exception("dropped an undecodable input message")
                    continue
                if not self.handle_inputs(inputs, out):
                    running = False
                    break
            if running and self.engine.has_unfinished_requests():
                if out.utility_results:
                    # Answers leave now: riding with the step's outputs they would wait a whole
                    # step for nothing (the dashboard's snapshot is taken before the step anyway).
                    output_socket.send(encode(StepOutputs(utility_results=out.utility_results)), copy=False)
                    out.utility_results = []
                self.step_outputs(out)
            out.snapshot = self.snapshot()
            output_socket.send(encode(out), copy=False)
            if slow_s is not None and time.perf_counter() - t0 >= slow_s:
                logger.warning("engine core: loop iteration took %.1f ms (%d outputs, %d unfinished)",
                               (time.perf_counter() - t0) * 1e3, len(out.outputs),
                               self.engine.get_num_unfinished_requests())


# ---- the process ------------------------------------------------------------------------------

def _exit_when_orphaned(parent_pid: int) -> None:
    """Runs in a daemon thread: the API server is our parent; once it is gone, so are we."""
    while True:
        time.sleep(PARENT_POLL_S)
        if os.getppid() != parent_pid:
            logger.error("the API server (pid %d) is gone; engine core exiting", parent_pid)
            os._exit(1)


def run_engine_core(config: EngineConfig | None, input_address: str, output_address: str,
                    parent_pid: int, engine: Any | None = None,
                    wrap_output: Callable[[Any], Any] | None = None, specs_checked: bool = False) -> int:
    """Process entry point: start up, send Ready (or StartupFailed), serve until Shutdown.
    engine: an engine already built instead of an LLMEngine from config (a benchmark's model-less
    one, pagedserve/benchmark/modelless_core.py); wrap_output: wraps the output socket the busy
    loop sends on (a benchmark's instrumentation). specs_checked: --specs-checked, the API server
    is in front (LLMEngine's specs_checked)."""
    import zmq
    threading.Thread(target=_exit_when_orphaned, args=(parent_pid,), daemon=True,
                     name="pagedserve-parent-watch").start()
    # Ctrl-C reaches the whole process group: the API server decides when the core stops.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    ctx = zmq.Context()
    inp = ctx.socket(zmq.PULL)
    inp.connect(input_address)
    out = ctx.socket(zmq.PUSH)
    out.setsockopt(zmq.SNDHWM, 0)
    out.connect(output_address)
    codec = Codec()
    try:
        # Text, stop strings and output shapes are the API server's (engine/text_output.py).
        core = EngineCore(config, engine=engine, detokenize=False, serving=True, specs_checked=specs_checked)
    except SystemExit:
        # SIGTERM mid start-up: the API server stopped this core (its own start-up failed, e.g. its
        # tokenizer) or the process group is stopping. Nobody waits for a StartupFailed.
        inp.close(linger=0)
        out.close(linger=0)
        ctx.term()
        raise
    except BaseException as e:
        # Bad settings are the user's to fix: the API server prints them, once, as one line.
        # Anything else needs the traceback, which only this process has.
        if not isinstance(e, ValueError):
            logger.error("engine core failed to start: %s", traceback.format_exc())
        out.send(codec.encode(StartupFailed(f"{type(e).__name__}: {e}")))
        # term() waits for every socket to close: an open input socket would hold this process
        # until the API server gave up on it (its 10 s shutdown wait, then SIGTERM).
        inp.close(linger=0)
        out.close(linger=2000)
        ctx.term()
        return 1
    trace = step_trace_from_env()
    if trace is not None:
        if getattr(core.engine, "device", None) is None or core.engine.device.type != "cuda":
            logger.warning("%s is set but the engine does not run on CUDA: no step trace", STEP_TRACE_ENV)
        else:
            core.engine.step_timer = trace
            # rank 0's runner, through either executor (a plain attribute, read after the step's launch)
            trace.graph_path_of = lambda: getattr(core.engine.runner, "last_graph_path", None)
            logger.info("tracing every step's shape and device time into %s", trace.path)
    # What start-up left alive stays alive: keep full collections from walking it mid-serving.
    frozen = freeze_startup_heap()
    install_gc_pause_log("engine core")
    logger.debug("froze %d start-up objects out of the garbage collector", frozen)
    logger.info("%s", core.describe())
    out.send(codec.encode(core.ready_message()))
    try:
        core.run_busy_loop(inp, wrap_output(out) if wrap_output else out)
    finally:
        core.shutdown()
        inp.close(linger=0)
        out.close(linger=1000)
        ctx.term()
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="pagedserve engine core (started by `pagedserve serve`)")
    p.add_argument("--config", required=True, help="EngineConfig as JSON")
    p.add_argument("--input", required=True, help="ZMQ address to pull inputs from")
    p.add_argument("--output", required=True, help="ZMQ address to push outputs to")
    p.add_argument("--parent-pid", type=int, required=True)
    p.add_argument("--specs-checked", action="store_true",
                   help="the API server has parsed every structured-output spec (MPCoreClient's specs_checked)")
    args = p.parse_args(argv)
    from pagedserve.log_setup import configure_logging
    configure_logging("engine-core")
    config = msgspec.json.decode(args.config, type=EngineConfig)
    return run_engine_core(config, args.input, args.output, args.parent_pid, specs_checked=args.specs_checked)


if __name__ == "__main__":
    sys.exit(main())
