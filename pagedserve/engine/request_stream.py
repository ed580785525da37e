"""One request's state in the AsyncLLMEngine and the async iterator its caller reads.

RequestStream's invariants: closing it (or its garbage collection) before the request finished
aborts the request, so a vanished consumer never leaks KV blocks; outputs that queued up while
the consumer was busy leave as one (deltas joined, cumulative outputs superseded), and an error
is raised after what came before it.
"""
from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any, Callable

from pagedserve.engine.text_output import RequestText
from pagedserve.outputs import RequestOutput, merge_deltas
from pagedserve.sampling_params import RequestOutputKind

@dataclass
class _RequestState:
    queue: asyncio.Queue
    arrival: float
    first_token_time: float | None = None
    last_token_time: float | None = None    # of the latest delivery with new tokens (inter-token latency)
    num_prompt_tokens: int = 0
    num_generated: int = 0
    finished: bool = False
    extra: dict = field(default_factory=dict)
    kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    # DELTA: tokens delivered so far per output index (the outputs only carry what is new).
    delta_lengths: dict[int, int] = field(default_factory=dict)
    finish_reasons: dict[int, str | None] = field(default_factory=dict)  # per output index, once finished
    # Text, stop strings, output shape; None when the server has no tokenizer (tokens only).
    text: RequestText | None = None
    # A beam search: makes its one core output (token ids) into the server's (text_output.beam_search_output).
    beam: Callable[[RequestOutput], RequestOutput] | None = None


class RequestStream:
    """The async iterator of one request's outputs. close() (or garbage collection) aborts
    the request if it has not finished, so a vanished consumer never leaks KV blocks. engine:
    the AsyncLLMEngine whose _release(request_id, state) frees it (not imported: no circle)."""

    def __init__(self, engine: Any, request_id: str, state: _RequestState) -> None:
        self.request_id = request_id
        self._engine = engine
        self._state = state
        self._done = False
        self._closed = False
        self._held: BaseException | None = None  # an error read while merging: raised next

    def __aiter__(self) -> "RequestStream":
        return self

    async def __anext__(self) -> RequestOutput:
        if self._done:
            raise StopAsyncIteration
        queue = self._state.queue
        if self._held is not None:
            item, self._held = self._held, None
        else:
            item = await queue.get()
        if isinstance(item, BaseException):
            self._done = True
            raise item
        # Outputs that queued up while the consumer was busy leave as one: under load every
        # output costs the server (and the client) a chunk to encode, write and parse whatever
        # it carries, so a consumer that falls behind catches up instead of falling further
        # behind (as vLLM's output collector merges). Nothing is lost: deltas are joined,
        # cumulative outputs superseded; an error waits for the next call.
        kind = self._state.kind
        while not item.finished and not queue.empty() and kind is not RequestOutputKind.FINAL_ONLY:
            nxt = queue.get_nowait()
            if isinstance(nxt, BaseException):
                self._held = nxt
                break
            if kind is RequestOutputKind.DELTA:
                item = merge_deltas(item, nxt)
            else:
                if nxt.prompt_logprobs is None and item.prompt_logprobs is not None:
                    nxt.prompt_logprobs = item.prompt_logprobs
                item = nxt
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
