"""What generate() returns, in vLLM's shape."""
from __future__ import annotations

from dataclasses import dataclass, field

from pagedserve.logprobs import Logprob

__all__ = ["BeamSearchOutput", "BeamSearchSequence", "CompletionOutput", "Logprob", "RequestOutput",
           "merge_deltas"]


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    # One dict per generated token: token id -> Logprob (pagedserve/logprobs.py), the chosen token
    # first, then the top-N (SamplingParams.logprobs). An engine core's outputs to the API server
    # carry the plain PositionLogprobs instead; the server makes them into these.
    logprobs: list[dict[int, Logprob]] | None
    finish_reason: str | None = None  # "stop" | "length" | "abort" | None while running
    stop_reason: int | str | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: dict | None = field(default=None, repr=False)
    # Set when the engine ended this request alone (finish_reason "abort"), saying why: e.g. its
    # structured_outputs grammar failed to compile or ran past structured_outputs_compile_timeout_s.
    error: str | None = None
    # SamplingParams.prompt_logprobs: per prompt position, token id -> Logprob (the prompt's own
    # token first, then the top-k), None at position 0 (nothing predicts it); set once the prompt
    # is computed. PositionLogprobs in an engine core's outputs, as CompletionOutput.logprobs.
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None

    @property
    def num_cached_tokens(self) -> int | None:
        """vLLM's: prompt tokens found in the prefix cache when the request was first scheduled."""
        return (self.metrics or {}).get("num_cached_tokens")


def merge_deltas(earlier: RequestOutput, later: RequestOutput) -> RequestOutput:
    """Two successive DELTA outputs of one request as one: each choice's new text, tokens and
    logprobs joined in order, everything that is a state (finish, cumulative logprob, metrics)
    the later one's, the prompt's logprobs (sent once) kept from whichever had them."""
    outputs = list(earlier.outputs)
    at = {c.index: i for i, c in enumerate(outputs)}
    for c in later.outputs:
        i = at.get(c.index)
        if i is None:
            at[c.index] = len(outputs)
            outputs.append(c)
            continue
        p = outputs[i]
        logprobs = None if p.logprobs is None and c.logprobs is None else (p.logprobs or []) + (c.logprobs or [])
        outputs[i] = CompletionOutput(c.index, p.text + c.text, p.token_ids + c.token_ids, c.cumulative_logprob,
                                      logprobs, c.finish_reason, c.stop_reason)
    return RequestOutput(later.request_id, later.prompt, later.prompt_token_ids, outputs, later.finished,
                         later.metrics, later.error or earlier.error,
                         earlier.prompt_logprobs if earlier.prompt_logprobs is not None else later.prompt_logprobs)


@dataclass
class BeamSearchSequence:
    """One finished beam. As in vLLM, `tokens` and `text` cover prompt + generated tokens.

    logprobs (vLLM's field): one dict per generated token (the EOS that ended a "stop" beam
    included), the step that produced it: token id -> Logprob of the top max(2 * beam_width,
    BeamSearchParams.logprobs) tokens of that step's raw log_softmax, in rank order (rank 1..N,
    decoded_token named as for sampled logprobs). The generated token is among them (it was a
    candidate) with the value cum_logprob sums. vLLM's dict, taken from a sampled one-token
    request, may hold one more token, drawn at random at temperature > 0; this one holds the
    top tokens only. A grammar's forbidden tokens (-inf) are left out.
    """
    tokens: list[int]
    cum_logprob: float
    score: float               # cum_logprob / generated_len ** length_penalty (HF's ranking)
    output_tokens: list[int]
    text: str | None = None
    output_text: str | None = None
    finish_reason: str | None = None  # "stop" (EOS) or "length"
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)


@dataclass
class BeamSearchOutput:
    """Beams of one prompt, best first."""
    sequences: list[BeamSearchSequence]
