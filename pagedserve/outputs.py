"""What generate() returns, in vLLM's shape."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    # One dict per generated token: token id -> logprob (top-N plus the chosen token).
    logprobs: list[dict[int, float]] | None
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
    # SamplingParams.prompt_logprobs: per prompt position, token id -> logprob (the prompt's own
    # token plus the top-k), None at position 0 (nothing predicts it); set once the prompt is computed.
    prompt_logprobs: list[dict[int, float] | None] | None = None


@dataclass
class BeamSearchSequence:
    """One finished beam. As in vLLM, `tokens` and `text` cover prompt + generated tokens."""
    tokens: list[int]
    cum_logprob: float
    score: float               # cum_logprob / generated_len ** length_penalty (HF's ranking)
    output_tokens: list[int]
    text: str | None = None
    output_text: str | None = None
    finish_reason: str | None = None  # "stop" (EOS) or "length"


@dataclass
class BeamSearchOutput:
    """Beams of one prompt, best first."""
    sequences: list[BeamSearchSequence]
