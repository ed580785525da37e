"""Sequence (one token stream) and SequenceGroup (one request: n streams sharing a prompt).

A sequence's KV lives in the cache for tokens [0, num_computed_tokens); the rest
(a prompt not yet prefilled, or the last sampled token) is what the scheduler
still has to run. Block tables are owned by the core's KV manager, keyed by seq_id.

With overlapped steps (EngineConfig.async_scheduling) a sequence may also hold placeholders:
tokens already sampled on the device by a step whose results the host has not seen yet
(num_inflight_tokens). They count in num_tokens, so the scheduler plans the next step as if
they were known; the engine replaces each placeholder with the real token when it arrives.
"""
from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass, field

from pagedserve.logprobs import Logprob, PositionLogprobs  # Logprob: vLLM's older vllm.sequence.Logprob
from pagedserve.sampling_params import SamplingParams

__all__ = ["Logprob", "Sequence", "SequenceGroup", "SequenceStatus"]

_seq_ids = itertools.count()


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    SWAPPED = "swapped"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    FINISHED_IGNORED = "ignored"  # rejected: can never fit
    FINISHED_REPETITION = "repetition"  # repetition_detection (vLLM's)

    def __init__(self, value: str) -> None:
        # Plain attributes, fixed per member: read for every sequence on every step.
        self.finished: bool = self.name.startswith("FINISHED")
        self.finish_reason: str | None = value if self.finished else None


@dataclass(eq=False)
class Sequence:
    prompt_token_ids: list[int]
    seq_id: int = field(default_factory=lambda: next(_seq_ids))
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    status: SequenceStatus = SequenceStatus.WAITING
    cumulative_logprob: float = 0.0
    # Per output token of a request with logprobs: its Logprob dict, or in an engine core that
    # serves the API server, its PositionLogprobs (OutputProcessor.logprob_objects).
    output_logprobs: list = field(default_factory=list)
    stop_reason: int | str | None = None
    # Detokenizer state lives here so a fork carries it along.
    output_text: str = ""
    detok_state: object = None
    # How much of this stream DELTA outputs have sent: output tokens (and their logprobs),
    # characters of output_text, and whether the finish_reason went out. A fork starts at zero:
    # it is a new stream to the client.
    sent_tokens: int = 0
    sent_text_len: int = 0
    sent_finish: bool = False
    # Tokens sampled on the device whose values the host does not know yet (0, 1, or 2 while
    # one step's results are processed after the next step was launched); and the row of this
    # sequence in the sampled-token tensor of the latest launched step (its newest placeholder).
    num_inflight_tokens: int = 0
    inflight_sample_row: int = -1
    # False for a request with prompt_logprobs: every prompt position must be computed, so it reads
    # no cached prefix (its own blocks are still offered to the cache).
    reads_prefix_cache: bool = True
    # vLLM's cache_salt: this sequence's blocks hash in a chain of their own (block_pool.cache_salt_root).
    cache_salt: str | None = None
    # Speculative decoding: tokens a proposer suggests after the last one, set by the engine just
    # before a step is scheduled and cleared after it. Never part of token_ids or num_tokens (they
    # are unverified): the scheduler may give the sequence lookahead slots for them, the runner
    # feeds them after its last token, and only those the verification accepts are appended.
    spec_token_ids: list[int] = field(default_factory=list)

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_slice(self, lo: int, hi: int) -> list[int]:
        """Known tokens [lo, hi) of prompt + outputs, without concatenating the whole list."""
        prompt, out = self.prompt_token_ids, self.output_token_ids
        p = len(prompt)
        if hi <= p:
            return prompt[lo:hi]
        if lo >= p:
            return out[lo - p:hi - p]
        return prompt[lo:] + out[:hi - p]

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_known_tokens(self) -> int:
        """Prompt + outputs the host holds (num_tokens minus placeholders)."""
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        """Prompt + outputs, counting placeholders (tokens sampled but not yet on the host)."""
        return len(self.prompt_token_ids) + len(self.output_token_ids) + self.num_inflight_tokens

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_decode(self) -> bool:
        """Whether the one token left to compute is the last sampled one (or its placeholder):
        the sequence is past its prompt and runs one token per step."""
        return (len(self.prompt_token_ids) + len(self.output_token_ids) + self.num_inflight_tokens
                - self.num_computed_tokens == 1) and bool(self.output_token_ids or self.num_inflight_tokens)

    def append_token(self, token_id: int, logprob: float = 0.0, top: object | None = None) -> None:
        self.output_token_ids.append(token_id)
        self.cumulative_logprob += logprob
        if top is not None:
            self.output_logprobs.append(top)

    def fork(self) -> "Sequence":
        """A child with the same tokens and a new id; the KV manager shares the blocks.
        Nothing of it has been sent yet (sent_* start at zero)."""
        return Sequence(
            prompt_token_ids=self.prompt_token_ids,
            output_token_ids=list(self.output_token_ids),
            num_computed_tokens=self.num_computed_tokens,
            status=self.status,
            cumulative_logprob=self.cumulative_logprob,
            output_logprobs=list(self.output_logprobs),
            output_text=self.output_text,
            detok_state=self.detok_state,
            cache_salt=self.cache_salt,
        )


@dataclass(eq=False)
class SequenceGroup:
    """One request. Starts with one sequence; n > 1 / best_of forks it after the prompt is computed."""
    request_id: str
    seqs: list[Sequence]
    sampling_params: SamplingParams
    arrival_time: float = 0.0
    prompt: str | None = None
    # Set by the scheduler when blocks are first reserved (admission order decides preemption victims).
    admitted_at: int | None = None
    # vLLM's request priority (lower first) under scheduling_policy "priority"; its arrival number
    # there (the scheduler's) breaks ties in waiting.
    priority: int = 0
    arrived_at: int = 0
    first_token_time: float | None = None
    # Used by the simulator and the contiguous-oracle baseline: the true output length, if known.
    oracle_output_len: int | None = None
    metrics: dict = field(default_factory=dict)
    # Why the engine ended this request alone (its grammar failed to compile, or timed out).
    error: str | None = None
    # SamplingParams.prompt_logprobs, filled position by position as prompt chunks are computed
    # (engine/prompt_logprobs.py: PositionLogprobs); whether a DELTA output has carried it; the
    # Logprob dicts made of it once, for outputs that carry them (OutputProcessor).
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    sent_prompt_logprobs: bool = False
    prompt_logprob_dicts: list | None = None

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.seqs[0].prompt_token_ids

    def unfinished_seqs(self) -> list[Sequence]:
        return [s for s in self.seqs if not s.status.finished]

    def seqs_with_status(self, status: SequenceStatus) -> list[Sequence]:
        return [s for s in self.seqs if s.status is status]

    @property
    def finished(self) -> bool:
        seqs = self.seqs
        if len(seqs) == 1:
            return seqs[0].status.finished
        return all(s.status.finished for s in seqs)

    @property
    def max_tokens(self) -> int:
        return self.sampling_params.max_tokens or 0
