"""The messages between the API server and the engine-core process, as msgspec Structs.

Traffic is batched both ways: the client sends a CoreInputs holding every add, abort and
utility call queued since its last send; the core answers each loop iteration (drain inputs,
step) with ONE StepOutputs holding every request's new output, the fate of the adds it took
(accepted / rejected with the engine's ValueError text), utility results and the scheduler's
gauges. Encoding is msgpack through msgspec: no pickle on the per-step path.

Invariant: a StepOutputs' outputs carry no prompt (the client keeps prompt and prompt ids from
the add), and metrics only once a request finished, so a step message is O(new tokens).
"""
from __future__ import annotations

from typing import Any

import msgspec

from pagedserve.logprobs import PositionLogprobs
from pagedserve.metrics import EngineSnapshot
from pagedserve.outputs import CompletionOutput
from pagedserve.sampling_params import BeamSearchParams, SamplingParams


# ---- client -> core ---------------------------------------------------------------------------

class AddRequest(msgspec.Struct, tag="add", array_like=True):
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float
    prompt: str | None = None
    cache_salt: str | None = None
    priority: int = 0


class AddBeamSearch(msgspec.Struct, tag="beam", array_like=True):
    """A beam search (LLMEngine.add_beam_search_request): its one output comes when it ends,
    every hypothesis in it, best first."""
    request_id: str
    prompt_token_ids: list[int]
    params: BeamSearchParams
    arrival_time: float
    prompt: str | None = None
    cache_salt: str | None = None
    priority: int = 0


class AbortRequests(msgspec.Struct, tag="abort", array_like=True):
    request_ids: list[str]


class UtilityCall(msgspec.Struct, tag="utility", array_like=True):
    """Call EngineCore method `method` (one marked @utility) with args; answered by call_id."""
    call_id: int
    method: str
    args: list[Any] = []


class Shutdown(msgspec.Struct, tag="shutdown", array_like=True):
    pass


CoreOp = AddRequest | AddBeamSearch | AbortRequests | UtilityCall | Shutdown


class CoreInputs(msgspec.Struct, array_like=True):
    """Ops in the order the client issued them (an abort after its add, never before)."""
    ops: list[CoreOp]


# ---- core -> client ---------------------------------------------------------------------------

class CompletionDelta(msgspec.Struct, array_like=True):
    """CompletionOutput on the wire (same fields, same meaning per output_kind); logprobs as the
    engine computed them, plain numbers (the server makes vLLM's Logprob objects)."""
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[PositionLogprobs] | None
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    @classmethod
    def of(cls, c: CompletionOutput) -> "CompletionDelta":
        return cls(c.index, c.text, c.token_ids, c.cumulative_logprob, c.logprobs,
                   c.finish_reason, c.stop_reason)

    def to_output(self) -> CompletionOutput:
        return CompletionOutput(self.index, self.text, self.token_ids, self.cumulative_logprob,
                                self.logprobs, self.finish_reason, self.stop_reason)


class RequestDelta(msgspec.Struct, array_like=True):
    request_id: str
    outputs: list[CompletionDelta]
    finished: bool
    metrics: dict[str, float] | None = None
    error: str | None = None      # RequestOutput.error: why the engine ended this request alone
    prompt_logprobs: list[PositionLogprobs | None] | None = None  # in one delta only (DELTA to the client)


class UtilityResult(msgspec.Struct, array_like=True):
    call_id: int
    result: Any = None
    error: str | None = None


class StepOutputs(msgspec.Struct, array_like=True):
    """Everything one core loop iteration produced."""
    outputs: list[RequestDelta] = []
    added: list[str] = []
    rejected: list[tuple[str, str]] = []     # (request_id, ValueError text)
    utility_results: list[UtilityResult] = []
    snapshot: EngineSnapshot | None = None
    failed: list[str] = []                   # requests a failed step took down
    step_error: str | None = None


class StepOutputsHead(msgspec.Struct, array_like=True):
    """A StepOutputs as the client first reads it: the same fields in the same places, with the
    outputs left encoded. Reading every waiting message this way costs next to nothing, so the
    answers to adds and utility calls need not wait behind the token outputs queued before them;
    each message's outputs are decoded (OUTPUTS) when their turn comes."""
    outputs: msgspec.Raw = msgspec.Raw()
    added: list[str] = []
    rejected: list[tuple[str, str]] = []
    utility_results: list[UtilityResult] = []
    snapshot: EngineSnapshot | None = None
    failed: list[str] = []
    step_error: str | None = None


OUTPUTS = list[RequestDelta]


class Ready(msgspec.Struct, tag="ready", array_like=True):
    """The core loaded the model, sized the KV cache and is waiting for requests."""
    pid: int
    max_model_len: int
    vocab_size: int
    num_gpu_blocks: int
    num_cpu_blocks: int
    block_size: int
    max_num_seqs: int
    eos_token_ids: list[int]
    max_logprobs: int = 20  # resolved: -1 (the whole vocabulary) is the vocabulary size here


class StartupFailed(msgspec.Struct, tag="startup_failed", array_like=True):
    error: str


class Codec:
    """The encoder and typed decoders, built once per process side (msgspec caches nothing
    per call, so reusing them is what makes the per-step cost small)."""

    def __init__(self) -> None:
        self.encoder = msgspec.msgpack.Encoder()
        self.inputs = msgspec.msgpack.Decoder(CoreInputs)
        self.step = msgspec.msgpack.Decoder(StepOutputs)
        self.step_head = msgspec.msgpack.Decoder(StepOutputsHead)
        self.step_outputs = msgspec.msgpack.Decoder(OUTPUTS)
        self.handshake = msgspec.msgpack.Decoder(Ready | StartupFailed)

    def encode(self, msg: msgspec.Struct) -> bytes:
        return self.encoder.encode(msg)
