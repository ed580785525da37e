"""AsyncLLMEngine: the engine loop behind the server, one async stream per request.

One LLMEngine serves every HTTP request (continuous batching happens inside its
scheduler). Every call into it — add_request, step, abort, tokenization — runs on one
dedicated worker thread, in submission order, so the engine is never entered twice at
once and the model forward never blocks the event loop. An asyncio task drives the loop:
while the engine has work, it runs step() on the worker and hands each RequestOutput to
the asyncio.Queue of its request, in the shape its SamplingParams.output_kind asks for
(the server streams DELTA outputs and answers non-streaming requests from FINAL_ONLY ones).

Invariant: a request whose stream is closed before it finished (client disconnect,
cancellation) is aborted, so its KV blocks go back to the pool.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable

from pagedserve.metrics import EngineSnapshot, ServerMetrics
from pagedserve.outputs import RequestOutput
from pagedserve.sampling_params import RequestOutputKind, SamplingParams

logger = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """step() raised: the requests in flight at that moment are failed with this error."""


@dataclass
class _RequestState:
    queue: asyncio.Queue
    arrival: float
    first_token_time: float | None = None
    num_prompt_tokens: int = 0
    num_generated: int = 0
    finished: bool = False
    extra: dict = field(default_factory=dict)
    kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    # DELTA: tokens delivered so far per output index (the outputs only carry what is new).
    delta_lengths: dict[int, int] = field(default_factory=dict)


class AsyncLLMEngine:
    """Serves many concurrent async generate() calls from one LLMEngine."""

    def __init__(self, engine: Any, metrics: ServerMetrics | None = None) -> None:
        self.engine = engine
        self.metrics = metrics or ServerMetrics()
        self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="pagedserve-engine")
        self._requests: dict[str, _RequestState] = {}
        self._wake: asyncio.Event | None = None
        self._loop_task: asyncio.Task | None = None
        self.errored: BaseException | None = None
        self._refresh_snapshot()

    @classmethod
    def from_engine_config(cls, config: Any, metrics: ServerMetrics | None = None) -> "AsyncLLMEngine":
        from pagedserve.engine.llm_engine import LLMEngine
        return cls(LLMEngine(config), metrics)

    # ---- what the serving layer needs to know about the engine -------------------------------

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return int(self.engine.max_model_len)

    @property
    def vocab_size(self) -> int:
        return int(self.engine.vocab_size)

    @property
    def kv_cache_shape(self) -> tuple[int, int]:
        """(device blocks, block size): a request needing more than all of it can never run."""
        cc = self.engine.cache_config
        return int(cc.num_gpu_blocks), int(cc.block_size)

    # ---- running things on the engine thread -------------------------------------------------

    async def run(self, fn: Callable, *args, **kwargs):
        """Run fn on the engine thread (after whatever is queued there) and await its result."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, lambda: fn(*args, **kwargs))

    def _ensure_loop(self) -> None:
        if self._loop_task is None or self._loop_task.done():
            self._wake = asyncio.Event()
            self._loop_task = asyncio.get_running_loop().create_task(self._run_loop())

    @property
    def is_running(self) -> bool:
        return self._loop_task is None or not self._loop_task.done()

    def _refresh_snapshot(self) -> None:
        """Called on the engine thread only."""
        try:
            # O(1): the snapshot needs no live-token count, which walks every block table.
            stats = self.engine.get_kv_cache_stats(token_counts=False)
            sched = self.engine.scheduler
            self.metrics.snapshot = EngineSnapshot(
                num_running=sched.num_running, num_waiting=sched.num_waiting,
                num_swapped=sched.num_swapped, kv_cache_usage=stats.usage,
                prefix_cache_hit_rate=stats.prefix_cache_hit_rate,
                num_preemptions=stats.num_preemptions,
                prefix_cache_queries=stats.prefix_cache_queries,
                prefix_cache_hits=stats.prefix_cache_hits)
        except Exception:  # metrics must never take the engine down
            logger.exception("could not read engine statistics")

    def _step_sync(self) -> list[RequestOutput] | None:
        if not self.engine.has_unfinished_requests():
            return None
        try:
            # Each RequestOutput holds fresh lists (cumulative outputs are copies, DELTA ones
            # new slices), so the event loop may read them while the next step runs.
            outs = self.engine.step()
        finally:
            self._refresh_snapshot()
        return outs

    def _add_sync(self, request_id: str, prompt: Any, params: SamplingParams, arrival: float) -> None:
        try:
            self.engine.add_request(request_id, prompt, params, arrival_time=arrival)
        finally:
            self._refresh_snapshot()

    def _abort_sync(self, request_ids: list[str]) -> None:
        try:
            self.engine.abort_request(request_ids)
        except Exception:
            logger.exception("abort of %s failed", request_ids)
        finally:
            self._refresh_snapshot()

    async def _run_loop(self) -> None:
        assert self._wake is not None
        while True:
            await self._wake.wait()
            self._wake.clear()
            while True:
                try:
                    outs = await self.run(self._step_sync)
                except Exception as e:
                    logger.exception("engine step failed; failing the requests in flight")
                    self._fail_all(e)
                    continue
                if outs is None:
                    break
                now = time.monotonic()
                for out in outs:
                    self._deliver(out, now)

    def _deliver(self, out: RequestOutput, now: float) -> None:
        st = self._requests.get(out.request_id)
        if st is None or st.finished:
            return
        m = self.metrics
        if st.kind is RequestOutputKind.DELTA:
            lengths = st.delta_lengths
            generated = st.num_generated
            for c in out.outputs:
                if c.token_ids:
                    lengths[c.index] = lengths.get(c.index, 0) + len(c.token_ids)
                    generated += len(c.token_ids)
        else:
            generated = sum(len(c.token_ids) for c in out.outputs)
        # A FINAL_ONLY request shows up only when it ends: its first-token time is the engine's.
        engine_clock = st.kind is RequestOutputKind.FINAL_ONLY and out.metrics is not None \
            and "first_token_time" in out.metrics
        if generated > st.num_generated:
            if st.first_token_time is None:
                st.first_token_time = now
                st.num_prompt_tokens = len(out.prompt_token_ids)
                m.prompt_tokens.inc(st.num_prompt_tokens)
                ttft = now - st.arrival
                if engine_clock:
                    ttft = out.metrics["first_token_time"] - out.metrics["arrival_time"]
                m.time_to_first_token.observe(ttft)
            m.generation_tokens.inc(generated - st.num_generated)
            st.num_generated = generated
        if out.finished:
            st.finished = True
            m.e2e_request_latency.observe(now - st.arrival)
            if st.kind is RequestOutputKind.DELTA:
                longest = max(st.delta_lengths.values(), default=0)
            else:
                longest = max((len(c.token_ids) for c in out.outputs), default=0)
            if st.first_token_time is not None and longest > 1:
                decode = now - st.first_token_time
                if engine_clock:
                    decode = out.metrics.get("finished_time", now) - out.metrics["first_token_time"]
                m.time_per_output_token.observe(decode / (longest - 1))
        st.queue.put_nowait(out)

    def _fail_all(self, error: BaseException) -> None:
        ids = [rid for rid, st in self._requests.items() if not st.finished]
        for rid in ids:
            st = self._requests[rid]
            st.finished = True
            st.queue.put_nowait(EngineDeadError(f"engine step failed: {error!r}"))
        if ids:
            self._executor.submit(self._abort_sync, ids)

    # ---- the public API ----------------------------------------------------------------------

    async def add_request(self, request_id: str, prompt: Any,
                          sampling_params: SamplingParams) -> "RequestStream":
        """Add a request to the engine; its outputs arrive on the returned stream.

        Raises ValueError (from the engine) for bad input. Closing the stream before the
        request finished aborts it.
        """
        self._ensure_loop()
        if request_id in self._requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        st = _RequestState(queue=asyncio.Queue(), arrival=time.monotonic(),
                           kind=getattr(sampling_params, "output_kind", RequestOutputKind.CUMULATIVE))
        self._requests[request_id] = st
        try:
            await self.run(self._add_sync, request_id, prompt, sampling_params, time.time())
        except BaseException as e:
            self._requests.pop(request_id, None)
            if not isinstance(e, ValueError):
                self.abort(request_id)  # cancelled while queued: the add may still run
            raise
        self._wake.set()
        return RequestStream(self, request_id, st)

    async def generate(self, prompt: Any, sampling_params: SamplingParams,
                       request_id: str) -> AsyncIterator[RequestOutput]:
        """add_request, then yield RequestOutputs (shaped by sampling_params.output_kind)
        until the request finishes."""
        stream = await self.add_request(request_id, prompt, sampling_params)
        try:
            async for out in stream:
                yield out
        finally:
            stream.close()

    def _release(self, request_id: str, st: _RequestState) -> None:
        if self._requests.get(request_id) is st:
            del self._requests[request_id]
        if not st.finished:
            self.abort(request_id)

    def abort(self, request_id: str | list[str]) -> None:
        """Abort without waiting; runs on the engine thread after anything queued before it."""
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        for rid in ids:
            st = self._requests.get(rid)
            if st is not None:
                st.finished = True
        try:
            self._executor.submit(self._abort_sync, ids)
        except RuntimeError:  # shut down: nothing left to free
            return
        if self._wake is not None:
            self._wake.set()

    async def shutdown(self) -> None:
        if self._loop_task is not None:
            self._loop_task.cancel()
            try:
                await self._loop_task
            except (asyncio.CancelledError, Exception):
                pass
        self._executor.shutdown(wait=False, cancel_futures=True)


class RequestStream:
    """The async iterator of one request's outputs. close() (or garbage collection) aborts
    the request if it has not finished, so a vanished consumer never leaks KV blocks."""

    def __init__(self, engine: AsyncLLMEngine, request_id: str, state: _RequestState) -> None:
        self.request_id = request_id
        self._engine = engine
        self._state = state
        self._done = False
        self._closed = False

    def __aiter__(self) -> "RequestStream":
        return self

    async def __anext__(self) -> RequestOutput:
        if self._done:
            raise StopAsyncIteration
        item = await self._state.queue.get()
        if isinstance(item, BaseException):
            self._done = True
            raise item
        if item.finished:
            self._done = True
        return item

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._engine._release(self.request_id, self._state)

    async def aclose(self) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass
