"""How a front end talks to an EngineCore: one interface, two transports.

- InprocCoreClient: the core lives in this process and is called directly, no IPC, no
  encoding (`LLM` uses it; the sync methods).
- MPCoreClient: the core runs in its own process (`python -m pagedserve.engine.core`); inputs
  go over a ZMQ PUSH socket and outputs come back over a PULL socket, msgpack-encoded by
  msgspec (the async methods, for the server's event loop). Adds and aborts queued during one
  event-loop iteration leave as one message (a utility call leaves at once, with whatever was
  queued before it); the core answers each of its loop iterations with one StepOutputs. The
  answers to adds and utility calls are delivered as soon as their message is read, ahead of
  the token outputs of messages read before it (get_output_async).

Invariant (MP): add_request_async returns once the core has taken the request (or raises the
engine's ValueError); the core's answer arrives in the same message as the request's first
outputs, so waiting for it costs no extra step.
"""
from __future__ import annotations

import asyncio
import collections
import itertools
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import msgspec

from pagedserve.config import EngineConfig
from pagedserve.engine.core_messages import (AbortRequests, AddBeamSearch, AddRequest, Codec, CoreInputs, Ready,
                                             Shutdown, StartupFailed, StepOutputsHead,
                                             UtilityCall)
from pagedserve.metrics import EngineSnapshot
from pagedserve.outputs import RequestOutput

logger = logging.getLogger(__name__)


# With messages waiting, get_output_async lets the event loop turn at least this often. Never
# turning let a backlog of 160 messages hold every other task for seconds; turning after every
# message made each stream wake for one output at a time: 37.6 us of API-server CPU per token
# against 25.3 with 50 ms slices and 23.1 never turning (benchmarks/dashboard/dashboard_latency.py).
DISPATCH_SLICE_S = 0.05
UNSENT_RETRY_S = 0.05  # how soon inputs the core could not take are offered again


class EngineDeadError(RuntimeError):
    """The requests in flight were lost: a step raised (status 500, the core lives on) or the
    engine-core process died (status 503, nothing will be served again)."""

    def __init__(self, message: str, status: int = 500, code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.code = code  # None: engine_dead for 503s (serving_common.engine_error)


@dataclass
class EngineCoreOutputs:
    """What one core step produced, as the front end sees it."""
    outputs: list[RequestOutput] = field(default_factory=list)
    snapshot: EngineSnapshot | None = None
    failed: list[str] = field(default_factory=list)   # request ids a failed step took down
    step_error: str | None = None


class EngineCoreClient:
    """The interface. Sync methods serve the offline `LLM`; *_async ones the server's loop.
    A transport implements the side its front end uses; abort_requests never blocks."""

    def add_request(self, request_id: str, prompt: Any, params: Any,
                    arrival_time: float | None = None, priority: int = 0) -> None:
        raise NotImplementedError

    async def add_request_async(self, request_id: str, prompt_token_ids: list[int], params: Any,
                                arrival_time: float, prompt: str | None = None, cache_salt: str | None = None,
                                priority: int = 0) -> None:
        raise NotImplementedError

    async def add_beam_search_async(self, request_id: str, prompt_token_ids: list[int], params: Any,
                                    arrival_time: float, prompt: str | None = None,
                                    cache_salt: str | None = None, priority: int = 0) -> None:
        raise NotImplementedError

    def abort_requests(self, request_ids: list[str]) -> None:
        raise NotImplementedError

    def get_output(self, final_only: bool = False) -> EngineCoreOutputs:
        raise NotImplementedError

    async def get_output_async(self) -> EngineCoreOutputs:
        raise NotImplementedError

    def get_output_nowait(self) -> EngineCoreOutputs | None:
        """The next outputs if they have already arrived and fail no request, else None; never
        waits. A transport without a read-ahead has none."""
        return None

    def call_utility(self, method: str, *args: Any) -> Any:
        raise NotImplementedError

    async def call_utility_async(self, method: str, *args: Any) -> Any:
        raise NotImplementedError

    def shutdown(self) -> None:
        raise NotImplementedError


class InprocCoreClient(EngineCoreClient):
    """The core in this process: every call is a direct call, outputs are the engine's own."""

    def __init__(self, config: EngineConfig | None = None, engine: Any | None = None) -> None:
        from pagedserve.engine.core import EngineCore
        self.core = EngineCore(config, engine)

    @property
    def engine(self) -> Any:
        return self.core.engine

    def add_request(self, request_id: str, prompt: Any, params: Any,
                    arrival_time: float | None = None, priority: int = 0) -> None:
        self.core.add_request(request_id, prompt, params, arrival_time, priority)

    def abort_requests(self, request_ids: list[str]) -> None:
        self.core.abort_requests(list(request_ids))

    def has_unfinished_requests(self) -> bool:
        return self.core.has_unfinished_requests()

    def get_output(self, final_only: bool = False) -> EngineCoreOutputs:
        from pagedserve.engine.core import StepFailed
        try:
            return EngineCoreOutputs(self.core.step(final_only=final_only))
        except StepFailed as e:
            raise e.__cause__  # offline callers see the step's own exception

    def call_utility(self, method: str, *args: Any) -> Any:
        return msgspec.to_builtins(self.core.call_utility(method, list(args)))

    def shutdown(self) -> None:
        self.core.shutdown()


def _describe_exit(pid: int, code: int) -> str:
    if code < 0:
        try:
            how = f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            how = f"was killed by signal {-code}"
    else:
        how = f"exited with code {code}"
    return f"the engine core process (pid {pid}) {how}"


class MPCoreClient(EngineCoreClient):
    """Starts the engine-core process and talks to it over ZMQ (ipc sockets in a temp dir).

    Construction blocks until the core is Ready (model loaded, KV cache sized, graphs
    captured) and raises if it fails to start. The async methods must all run on one event loop.
    """

    def __init__(self, config: EngineConfig, ready_timeout_s: float = 3600.0,
                 core_cmd: list[str] | None = None, specs_checked: bool = False,
                 while_starting: Callable[[], None] | None = None) -> None:
        """core_cmd: the program to start instead of `python -m pagedserve.engine.core`, given
        the same flags (a benchmark's model-less core behind this very transport).
        specs_checked: the API server is in front (--specs-checked; LLMEngine's specs_checked).
        while_starting: this process's own start-up work (the tokenizer's load), run once the core
        process is launched and before waiting for its Ready, so the two overlap; if it raises, the
        core is stopped at once (it has nothing to finish) and the error goes to the caller."""
        import zmq
        self._codec = Codec()
        self._dir = tempfile.mkdtemp(prefix="pagedserve-core-")
        in_addr, out_addr = f"ipc://{self._dir}/inputs", f"ipc://{self._dir}/outputs"
        self._ctx = zmq.Context()
        self._input = self._ctx.socket(zmq.PUSH)
        self._input.setsockopt(zmq.SNDHWM, 0)
        self._input.bind(in_addr)
        self._output = self._ctx.socket(zmq.PULL)
        self._output.setsockopt(zmq.RCVHWM, 0)
        self._output.bind(out_addr)
        self._async_output: Any = None
        cmd = [*(core_cmd or [sys.executable, "-m", "pagedserve.engine.core"]), "--config",
               msgspec.json.encode(config).decode(), "--input", in_addr, "--output", out_addr,
               "--parent-pid", str(os.getpid()), *(["--specs-checked"] if specs_checked else [])]
        # Our stdout/stderr: the core's log lines land beside the server's.
        self.proc = subprocess.Popen(cmd)
        self._closed = False
        launched_only = True
        try:
            if while_starting is not None:
                while_starting()
            launched_only = False
            self.ready = self._wait_ready(ready_timeout_s)
        except BaseException:
            self.shutdown(timeout_s=0.0 if launched_only else 10.0)
            raise
        self._ops: list[Any] = []
        self._flush_handle: asyncio.Handle | None = None
        self._prompts: dict[str, tuple[str | None, list[int]]] = {}
        self._adds: dict[str, asyncio.Future] = {}
        self._utility: dict[int, asyncio.Future] = {}
        self._read_ahead: collections.deque[StepOutputsHead] = collections.deque()
        self._turned_at = 0.0  # when get_output_async last let the event loop turn
        self._call_ids = itertools.count()
        self.dead: EngineDeadError | None = None

    @property
    def pid(self) -> int:
        return self.proc.pid

    def _wait_ready(self, timeout_s: float) -> Ready:
        import zmq
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._output.poll(200, zmq.POLLIN):
                msg = self._codec.handshake.decode(self._output.recv())
                if isinstance(msg, StartupFailed):
                    cls = ValueError if msg.error.startswith("ValueError: ") else RuntimeError
                    raise cls(msg.error.removeprefix("ValueError: "))
                return msg
            code = self.proc.poll()
            if code is not None:
                raise RuntimeError(_describe_exit(self.proc.pid, code) + " during start-up")
        raise RuntimeError(f"the engine core did not start within {timeout_s:.0f} s")

    def dead_reason(self) -> str | None:
        """None while the core process runs; else what happened to it."""
        code = self.proc.poll()
        return None if code is None else _describe_exit(self.proc.pid, code)

    # ---- sending: one message per event-loop iteration ---------------------------------------

    def _queue(self, op: Any) -> None:
        self._ops.append(op)
        if self._flush_handle is None:
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:
                self._flush()
                return
            self._flush_handle = loop.call_soon(self._flush)

    def _flush(self) -> None:
        if self._flush_handle is not None:
            self._flush_handle.cancel()  # when called directly; a no-op from the handle itself
            self._flush_handle = None
        if not self._ops or self._closed:
            return
        import zmq
        try:
            # NOBLOCK: with SNDHWM 0 a send waits only when the PUSH has no peer, i.e. the core
            # died and ZMQ saw its end close. A blocking send would then freeze this event loop,
            # and with it the watch that fails every request with the core's death (a request
            # that came in the watch's 0.2 s blind spot hung its server, and its caller, for good).
            self._input.send(self._codec.encode(CoreInputs(self._ops)), flags=zmq.NOBLOCK, copy=False)
        except zmq.Again:
            if self.dead is None:  # kept, and tried again, until the watch declares the core dead
                self._retry_flush()
            return
        self._ops = []

    def _retry_flush(self) -> None:
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # no loop: they go with the next flush
            return
        if self._flush_handle is None:
            self._flush_handle = loop.call_later(UNSENT_RETRY_S, self._flush)

    async def add_request_async(self, request_id: str, prompt_token_ids: list[int], params: Any,
                                arrival_time: float, prompt: str | None = None, cache_salt: str | None = None,
                                priority: int = 0) -> None:
        """Raises the engine's ValueError if the core rejects it, EngineDeadError if it is gone."""
        await self._add(AddRequest(request_id, prompt_token_ids, params, arrival_time, prompt, cache_salt, priority))

    async def add_beam_search_async(self, request_id: str, prompt_token_ids: list[int], params: Any,
                                    arrival_time: float, prompt: str | None = None,
                                    cache_salt: str | None = None, priority: int = 0) -> None:
        """add_request_async for a beam search (BeamSearchParams): one output, when it ends."""
        await self._add(AddBeamSearch(request_id, prompt_token_ids, params, arrival_time, prompt, cache_salt,
                                      priority))

    async def _add(self, op: AddRequest | AddBeamSearch) -> None:
        if self.dead is not None:
            raise self.dead
        request_id = op.request_id
        fut = asyncio.get_running_loop().create_future()
        self._adds[request_id] = fut
        self._prompts[request_id] = (op.prompt, op.prompt_token_ids)
        self._queue(op)
        try:
            await fut
        except BaseException:
            self._adds.pop(request_id, None)
            self._prompts.pop(request_id, None)
            raise

    def abort_requests(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            self._prompts.pop(rid, None)
        if self.dead is None:
            self._queue(AbortRequests(list(request_ids)))

    async def call_utility_async(self, method: str, *args: Any) -> Any:
        """Run an EngineCore @utility method in the core, after the inputs queued before it."""
        if self.dead is not None:
            raise self.dead
        call_id = next(self._call_ids)
        fut = asyncio.get_running_loop().create_future()
        self._utility[call_id] = fut
        self._queue(UtilityCall(call_id, method, list(args)))
        # Sent now rather than when this loop iteration ends: under load one can take long.
        self._flush()
        try:
            return await fut
        finally:
            self._utility.pop(call_id, None)

    # ---- receiving ---------------------------------------------------------------------------

    async def get_output_async(self) -> EngineCoreOutputs:
        """The next StepOutputs, in the order the core sent them, its answers already delivered.

        Every message already waiting is read (outputs left encoded) and its add and utility
        answers delivered before the outputs of any of them are handed out: under heavy
        streaming a dashboard snapshot's reply would otherwise wait behind all the tokens queued
        before it. While messages wait, the event loop turns at least every DISPATCH_SLICE_S:
        reading them back to back never suspends, and a backlog held up every other task (HTTP
        handlers, the dashboard's stream) until it was gone, for seconds.
        """
        import zmq
        if self._async_output is None:
            import zmq.asyncio
            self._async_output = zmq.asyncio.Socket.from_socket(self._output)
        if self._read_ahead or self._output.get(zmq.EVENTS) & zmq.POLLIN:
            if time.monotonic() - self._turned_at >= DISPATCH_SLICE_S:
                await asyncio.sleep(0)
                self._turned_at = time.monotonic()
            self._read_waiting()
        while not self._read_ahead:
            self._answer(await self._async_output.recv(copy=False))  # nothing waiting: the loop turns
            self._turned_at = time.monotonic()
            self._read_waiting()
        return self._decode_outputs(self._read_ahead.popleft())

    def get_output_nowait(self) -> EngineCoreOutputs | None:
        """The next outputs already read or waiting in the socket, else None. A message that
        fails requests (a step's error) is left for get_output_async: its failures are handled
        before its outputs, and must not overtake the outputs of the messages before it."""
        if not self._read_ahead:
            self._read_waiting()
        if not self._read_ahead or self._read_ahead[0].failed or self._read_ahead[0].step_error:
            return None
        return self._decode_outputs(self._read_ahead.popleft())

    def _decode_outputs(self, msg: StepOutputsHead) -> EngineCoreOutputs:
        outputs = []
        prompts = self._prompts
        for d in self._codec.step_outputs.decode(msg.outputs):
            p = prompts.get(d.request_id)
            if p is None:  # aborted here after the core produced this
                continue
            if d.finished:
                del prompts[d.request_id]
            outputs.append(RequestOutput(d.request_id, p[0], p[1], [c.to_output() for c in d.outputs],
                                         d.finished, d.metrics, d.error, d.prompt_logprobs))
        for rid in msg.failed:
            prompts.pop(rid, None)
        return EngineCoreOutputs(outputs, msg.snapshot, msg.failed, msg.step_error)

    def _read_waiting(self) -> None:
        """Read every message already in the socket without waiting (the asyncio socket is a
        shadow of _output: a non-blocking read on either is the same call)."""
        import zmq
        while True:
            try:
                frame = self._output.recv(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            self._answer(frame)

    def _answer(self, frame: Any) -> None:
        """Decode a message's head, deliver its add and utility answers, queue its outputs."""
        msg = self._codec.step_head.decode(frame.buffer)
        self._read_ahead.append(msg)
        for rid in msg.added:
            fut = self._adds.pop(rid, None)
            if fut is not None and not fut.done():
                fut.set_result(None)
        for rid, error in msg.rejected:
            self._prompts.pop(rid, None)
            fut = self._adds.pop(rid, None)
            if fut is not None and not fut.done():
                fut.set_exception(ValueError(error))
        for r in msg.utility_results:
            fut = self._utility.get(r.call_id)
            if fut is not None and not fut.done():
                if r.error is None:
                    fut.set_result(r.result)
                else:
                    fut.set_exception(RuntimeError(f"engine-core utility failed: {r.error}"))

    def fail(self, error: EngineDeadError) -> None:
        """The core is gone: every pending add and utility call raises `error` from now on."""
        self.dead = error
        self._ops.clear()  # never to be sent
        for fut in list(self._adds.values()) + list(self._utility.values()):
            if not fut.done():
                fut.set_exception(error)
        self._adds.clear()
        self._prompts.clear()

    def shutdown(self, timeout_s: float = 10.0) -> None:
        """Ask the core to stop, then make sure it did. Idempotent."""
        if self._closed:
            return
        if self.proc.poll() is None:
            import zmq
            try:
                # NOBLOCK: a PUSH with no peer blocks forever, and a core that is exiting on its
                # own (SIGTERM to the whole process group) has already closed its end.
                self._input.send(self._codec.encode(CoreInputs([Shutdown()])), flags=zmq.NOBLOCK)
            except zmq.Again:
                pass
            try:
                self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.terminate()
                try:
                    self.proc.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    self.proc.kill()
                    self.proc.wait()
        self._closed = True
        # The asyncio socket is a shadow of _output: closing the owner closes both.
        self._input.close(linger=0)
        self._output.close(linger=0)
        self._ctx.destroy(linger=0)  # closes any socket still open (term() would wait on it)
        shutil.rmtree(self._dir, ignore_errors=True)
