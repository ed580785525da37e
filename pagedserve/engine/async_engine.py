"""AsyncLLMEngine: the server's engine object, one async stream per request, the core elsewhere.

The engine core (scheduler, KV manager, runner: pagedserve.engine.core) runs in its own process
behind an MPCoreClient, so the model never competes with HTTP, JSON and SSE for this process's
interpreter lock. Here: tokenization (on one worker thread), one output-dispatch task that reads
each step's batched message and hands every RequestOutput to the asyncio.Queue of its request
(in the shape its SamplingParams.output_kind asks for), the latency metrics, and a watcher that
notices a dead core.

Invariants:
- a request whose stream is closed before it finished (client disconnect, cancellation) is
  aborted in the core, which frees its KV blocks before its next step;
- once the core process is gone every request in flight fails with EngineDeadError (status
  503), every new one is refused with the same error, and on_core_death is called once.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import logging
import threading
import time
from typing import Any, AsyncIterator, Callable

from pagedserve.engine.bad_words import with_bad_word_ids
from pagedserve.engine.core_client import EngineDeadError, MPCoreClient
from pagedserve.engine.input_processor import load_tokenizer, split_prompt, truncated_prompt
from pagedserve.engine.logprob_tokens import LogprobTokens
from pagedserve.engine.request_stream import RequestStream, _RequestState
from pagedserve.engine.text_output import RequestText, beam_search_output, core_params, unnamed_logprobs
from pagedserve.metrics import ServerMetrics
from pagedserve.outputs import RequestOutput, merge_deltas
from pagedserve.sampling_params import BeamSearchParams, RequestOutputKind, SamplingParams

__all__ = ["AsyncLLMEngine", "EngineDeadError", "RequestStream", "load_tokenizer"]

logger = logging.getLogger(__name__)

CORE_POLL_S = 0.2
# How many waiting step messages one dispatch joins per request (_catch_up): enough to catch up
# from a second's lag in a few rounds, few enough that one round stays a short turn of the loop.
CATCH_UP_MESSAGES = 16


class AsyncLLMEngine:
    """Serves many concurrent async generate() calls from one engine-core process."""

    def __init__(self, client: MPCoreClient, tokenizer: Any | None,
                 metrics: ServerMetrics | None = None,
                 on_core_death: Callable[[EngineDeadError], None] | None = None) -> None:
        self.client = client
        self.tokenizer = tokenizer
        # Names logprob tokens for every request (it caches each id's text).
        self._logprob_tokens = LogprobTokens(tokenizer) if tokenizer is not None else None
        self.metrics = metrics or ServerMetrics()
        self.on_core_death = on_core_death
        ready = client.ready
        self.max_model_len = ready.max_model_len
        self.vocab_size = ready.vocab_size
        self.eos_token_ids = set(ready.eos_token_ids)
        self._kv_cache_shape = (ready.num_gpu_blocks, ready.block_size)
        self.max_num_seqs = ready.max_num_seqs
        self.max_logprobs = ready.max_logprobs
        self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="pagedserve-tokenizer")
        self._requests: dict[str, _RequestState] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_thread: int | None = None
        self._tasks: list[asyncio.Task] = []
        self.errored: EngineDeadError | None = None
        # vllm:cache_config_info's labels: the KV cache the core sized.
        self.metrics.cache_config.update(block_size=str(ready.block_size), num_gpu_blocks=str(ready.num_gpu_blocks),
                                         num_cpu_blocks=str(ready.num_cpu_blocks))

    @classmethod
    def from_engine_config(cls, config: Any, metrics: ServerMetrics | None = None,
                           specs_checked: bool = False) -> "AsyncLLMEngine":
        """Start the core process, load the tokenizer here while it starts (both import torch and
        transformers: seconds each), then wait until the core is ready. With a --chat-template the
        tokenizer comes first: a template that does not compile is refused before any process starts.
        specs_checked: only for the OpenAI API server, which parses every structured-output spec
        itself (entrypoints/openai/structured_outputs.py): the core then leaves the parse to its
        grammar compile thread, and a spec that fails there fails its request alone instead of
        add_request raising the ValueError a direct user gets."""
        tokenizer = None

        def load() -> None:
            nonlocal tokenizer
            if not config.skip_tokenizer_init:
                tokenizer = load_tokenizer(config.tokenizer or config.model, config.chat_template)

        if config.chat_template is not None:
            load()
        client = MPCoreClient(config, specs_checked=specs_checked, while_starting=load if tokenizer is None else None)
        logger.info("engine core ready (pid %d)", client.pid)
        engine = cls(client, tokenizer, metrics)
        engine.metrics.cache_config.update(enable_prefix_caching=str(config.enable_prefix_caching),
                                           kv_allocator=str(config.kv_allocator),
                                           swap_space=str(config.swap_space))
        return engine

    # ---- what the serving layer needs to know about the engine -------------------------------

    @property
    def kv_cache_shape(self) -> tuple[int, int]:
        """(device blocks, block size): a request needing more than all of it can never run."""
        return self._kv_cache_shape

    @property
    def num_unfinished_requests(self) -> int:
        """Requests added and not yet released: running or waiting in the core."""
        return len(self._requests)

    def stop_requests(self, message: str, code: str | None = None) -> None:
        """End every request in flight with a 503 (their handlers answer it cleanly) and abort
        them in the core: the server is shutting down."""
        err = EngineDeadError(message, status=503, code=code)
        ids = list(self._requests)
        self._fail(ids, err)
        if self.errored is None and ids:
            self.client.abort_requests(ids)

    @property
    def is_running(self) -> bool:
        return self.errored is None

    async def run(self, fn: Callable, *args, **kwargs):
        """Run fn (tokenization, chat templates) on the worker thread and await its result."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, lambda: fn(*args, **kwargs))

    async def get_kv_cache_stats(self, token_counts: bool = True) -> dict:
        return await self.client.call_utility_async("get_kv_cache_stats", token_counts)

    # ---- background tasks --------------------------------------------------------------------

    def start(self) -> None:
        """Start the output-dispatch and core-watch tasks on the running loop (idempotent)."""
        if self._tasks or self.errored is not None:
            return
        self._loop = asyncio.get_running_loop()
        self._loop_thread = threading.get_ident()
        self._tasks = [self._loop.create_task(self._dispatch_outputs()),
                       self._loop.create_task(self._watch_core())]

    async def _dispatch_outputs(self) -> None:
        client = self.client
        try:
            while True:
                out = await client.get_output_async()
                if out.snapshot is not None:
                    self.metrics.observe_snapshot(out.snapshot)
                if out.failed:
                    self._fail(out.failed, EngineDeadError(out.step_error or "engine step failed"))
                now = time.monotonic()
                requests = self._requests
                for core_out in self._catch_up(out.outputs):
                    st = requests.get(core_out.request_id)
                    if st is None or st.finished:
                        continue
                    o = core_out
                    if st.beam is not None:  # its only output, at its end: the engine's clock times it
                        self._deliver(st, st.beam(core_out), now)
                        continue
                    if st.first_token_time is None and any(c.token_ids for c in core_out.outputs):
                        # The core streams tokens as they come, whatever shape the caller takes.
                        self._first_token(st, core_out, now, now - st.arrival)
                    if st.text is not None:
                        o = st.text.process(core_out)
                        if st.text.finished and not core_out.finished:
                            # Done here (stop strings) but not in the core: free its blocks.
                            client.abort_requests([core_out.request_id])
                        if o is None:
                            continue
                    else:
                        o = unnamed_logprobs(core_out)
                    self._deliver(st, o, now)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # an undecodable message: nothing more can be trusted
            logger.exception("engine-core output dispatch failed")
            self._core_died(f"reading the engine core's outputs failed: {e!r}")

    def _catch_up(self, outputs: list[RequestOutput]) -> list[RequestOutput]:
        """These outputs, each joined with the same request's outputs of the steps that have
        arrived since (up to CATCH_UP_MESSAGES messages).

        Behind the core (a burst of arrivals, a slow host) this process otherwise spends its
        per-output work (text, metrics, the stream's wake-up) on every step of every request,
        and falls further behind; joined, a request's k late tokens cost one output, one
        detokenization of the k tokens, one delivery. Core outputs are token-only DELTAs where a
        tokenizer is here (core_params); without one only DELTA requests are joined; requests with
        stop strings never (their text is cut token by token anyway).
        """
        more = []
        while len(more) < CATCH_UP_MESSAGES - 1:
            nxt = self.client.get_output_nowait()
            if nxt is None:
                break
            if nxt.snapshot is not None:
                self.metrics.observe_snapshot(nxt.snapshot)
            more.append(nxt.outputs)
        if not more:
            return outputs
        joined = list(outputs)
        at = {o.request_id: i for i, o in enumerate(joined)}
        requests = self._requests
        for outs in more:
            for o in outs:
                i = at.get(o.request_id)
                st = requests.get(o.request_id)
                # Not joined: a request with stop strings (a cut inside a joined chunk would leave it
                # the chunk's last cumulative logprob, run-on tokens and all: one token a step is exact).
                if i is None or st is None or (st.text is None and st.kind is not RequestOutputKind.DELTA) \
                        or (st.text is not None and st.text.params.stop):
                    at[o.request_id] = len(joined)
                    joined.append(o)
                else:
                    joined[i] = merge_deltas(joined[i], o)
        return joined

    async def _watch_core(self) -> None:
        while self.errored is None:
            await asyncio.sleep(CORE_POLL_S)
            reason = self.client.dead_reason()
            if reason is not None:
                self._core_died(reason)

    def _core_died(self, reason: str) -> None:
        if self.errored is not None:
            return
        err = EngineDeadError(f"engine core is dead: {reason}", status=503)
        logger.error("%s; failing every request", err)
        self.errored = err
        self.client.fail(err)
        self._fail(list(self._requests), err)
        for t in self._tasks:
            if t is not asyncio.current_task():
                t.cancel()
        if self.on_core_death is not None:
            self.on_core_death(err)

    def _fail(self, request_ids: list[str], error: EngineDeadError) -> None:
        for rid in request_ids:
            st = self._requests.get(rid)
            if st is not None and not st.finished:
                st.finished = True
                st.queue.put_nowait(error)

    def _first_token(self, st: _RequestState, out: RequestOutput, now: float, ttft: float) -> None:
        st.first_token_time = now
        st.num_prompt_tokens = len(out.prompt_token_ids)
        self.metrics.prompt_tokens.inc(st.num_prompt_tokens)
        self.metrics.time_to_first_token.observe(ttft)

    def _deliver(self, st: _RequestState, out: RequestOutput, now: float) -> None:
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
        # Without a tokenizer here, a FINAL_ONLY request crosses from the core only when it
        # ends: its first-token time is the engine's.
        engine_clock = st.kind is RequestOutputKind.FINAL_ONLY and out.metrics is not None \
            and "first_token_time" in out.metrics
        if generated > st.num_generated:
            if st.first_token_time is None:
                ttft = now - st.arrival
                if engine_clock:
                    ttft = out.metrics["first_token_time"] - out.metrics["arrival_time"]
                self._first_token(st, out, now, ttft)
            elif st.last_token_time is not None:
                m.inter_token_latency.observe(now - st.last_token_time)
            st.last_token_time = now
            m.generation_tokens.inc(generated - st.num_generated)
            st.num_generated = generated
        for c in out.outputs:
            if c.finish_reason is not None:
                st.finish_reasons[c.index] = c.finish_reason
        if out.finished:
            st.finished = True
            m.e2e_request_latency.observe(now - st.arrival)
            if st.kind is RequestOutputKind.DELTA:
                lengths = list(st.delta_lengths.values())
            else:
                lengths = [len(c.token_ids) for c in out.outputs]
            n = max(len(lengths), len(st.finish_reasons), 1)
            m.observe_finished(st.num_prompt_tokens or len(out.prompt_token_ids or ()), lengths,
                               [st.finish_reasons.get(i) for i in range(n)], out.metrics)
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

    # ---- the public API ----------------------------------------------------------------------

    async def _prompt_ids(self, prompt: Any, truncate_prompt_tokens: int | None = None) -> tuple[str | None, list[int]]:
        """Tokenize here (the core gets ids); the core checks lengths and the vocabulary. Cut
        here too, not only in the core: the outputs' prompt_token_ids and prompt logprobs come
        from these ids (the core's cut of them is then a no-op)."""
        text, ids = split_prompt(prompt, can_tokenize=self.tokenizer is not None)
        if ids is None:
            ids, _ = await self.run(truncated_prompt, self.tokenizer, text, truncate_prompt_tokens,
                                    self.max_model_len)
        else:
            ids, _ = truncated_prompt(None, ids, truncate_prompt_tokens, self.max_model_len)
        return text, ids

    async def add_request(self, request_id: str, prompt: Any,
                          sampling_params: SamplingParams, priority: int = 0) -> "RequestStream":
        """Add a request to the engine; its outputs arrive on the returned stream.

        Raises ValueError (from the core) for bad input, EngineDeadError once the core is gone.
        Closing the stream before the request finished aborts it.
        """
        if not isinstance(sampling_params, SamplingParams):
            raise ValueError(f"sampling_params must be a SamplingParams, got {type(sampling_params).__name__}")
        text, ids = await self._admit(request_id, prompt, sampling_params.truncate_prompt_tokens)
        st = _RequestState(queue=asyncio.Queue(), arrival=time.monotonic(),
                           kind=sampling_params.output_kind)
        sampling_params = with_bad_word_ids(sampling_params, self.tokenizer)
        wire_params = sampling_params
        if self.tokenizer is not None:  # the core then runs without detokenizing
            st.text = RequestText(self.tokenizer, sampling_params, text, ids, self._logprob_tokens)
            wire_params = core_params(sampling_params)
        return await self._send(request_id, prompt, st, self.client.add_request_async,
                                ids, wire_params, text, priority)

    async def add_beam_search_request(self, request_id: str, prompt: Any, params: BeamSearchParams,
                                      priority: int = 0, skip_special_tokens: bool = True,
                                      include_stop_str_in_output: bool = False) -> "RequestStream":
        """A beam search (LLM.beam_search's, run in the core beside every other request); its
        stream yields one RequestOutput when it ends: each hypothesis a CompletionOutput, best
        first, in the shape of vLLM's server (text_output.beam_search_output)."""
        if not isinstance(params, BeamSearchParams):
            raise ValueError(f"params must be a BeamSearchParams, got {type(params).__name__}")
        text, ids = await self._admit(request_id, prompt)
        st = _RequestState(queue=asyncio.Queue(), arrival=time.monotonic(), kind=RequestOutputKind.FINAL_ONLY,
                           beam=functools.partial(beam_search_output, tokenizer=self.tokenizer,
                                                  skip_special_tokens=skip_special_tokens,
                                                  include_stop_str_in_output=include_stop_str_in_output,
                                                  logprob_tokens=self._logprob_tokens))
        return await self._send(request_id, prompt, st, self.client.add_beam_search_async, ids, params, text, priority)

    async def _admit(self, request_id: str, prompt: Any,
                     truncate_prompt_tokens: int | None = None) -> tuple[str | None, list[int]]:
        if self.errored is not None:
            raise self.errored
        self.start()
        if request_id in self._requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        return await self._prompt_ids(prompt, truncate_prompt_tokens)

    async def _send(self, request_id: str, prompt: Any, st: _RequestState, add: Callable,
                    ids: list[int], params: Any, text: str | None, priority: int) -> "RequestStream":
        """Register the request and hand it to the core (add: one of the client's add calls)."""
        self._requests[request_id] = st
        try:
            salt = prompt.get("cache_salt") if isinstance(prompt, dict) else None
            await add(request_id, ids, params, time.time(), text, salt, priority)
        except BaseException as e:
            self._requests.pop(request_id, None)
            if not isinstance(e, (ValueError, EngineDeadError)):
                self.abort(request_id)  # cancelled while the core took it: it may be running
            raise
        return RequestStream(self, request_id, st)

    async def get_kv_cache_state(self) -> dict:
        """LLMEngine.get_kv_cache_state, taken in the core between two steps."""
        return await self.client.call_utility_async("get_kv_cache_state")

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
        """Abort without waiting; the core frees the blocks before its next step. Safe to call
        from any thread (a stream garbage-collected elsewhere)."""
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        loop = self._loop
        if loop is not None and threading.get_ident() != self._loop_thread:
            if not loop.is_closed():
                loop.call_soon_threadsafe(self.abort, ids)
            return
        for rid in ids:
            st = self._requests.get(rid)
            if st is not None:
                st.finished = True
        if self.errored is None:
            self.client.abort_requests(ids)

    async def shutdown(self) -> None:
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks = []
        await asyncio.get_running_loop().run_in_executor(None, self.client.shutdown)
        self._executor.shutdown(wait=False, cancel_futures=True)
