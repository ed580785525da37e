"""Beam search bookkeeping with HF transformers' semantics (num_beams=k, early_stopping=True).

Pure decision logic, no tensors and no cache: the engine feeds each live beam's top 2k
next-token logprobs, this returns which (parent, token) continuations live on; the engine
turns that into forks (shared blocks, copy-on-write) and frees.

One step, as HF's vectorised BeamSearch does it:
  - candidates: every live beam's top 2k tokens, scored cum_logprob + logprob; keep the best 2k;
  - a candidate "hits" if its token is EOS (unless ignore_eos) or it reaches max_tokens;
  - the next live beams are the best k candidates that did not hit;
  - candidates that hit AND rank among the best k join the finished pool with score
    cum_logprob / generated_len ** length_penalty (generated_len counts the EOS token);
    the pool keeps its best k;
  - search ends once the pool holds k hypotheses, or no candidate is left to continue.

Each beam also carries one record per token it generated (the engine's top tokens of the step
that produced it; opaque here): a hypothesis takes its beam's records plus the step it ended in.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pagedserve.sampling_params import BeamSearchParams


@dataclass
class Hypothesis:
    output_tokens: list[int]
    cum_logprob: float
    score: float
    finish_reason: str
    steps: list = field(default_factory=list)  # one record per output token (LiveBeam.steps)


@dataclass
class LiveBeam:
    """What the search needs to know about one live beam this step."""
    output_tokens: list[int]
    cum_logprob: float
    top_token_ids: list[int]    # its best 2k next tokens, best first
    top_logprobs: list[float]
    steps: list = field(default_factory=list)  # a record per output token so far, oldest first
    step: Any = None                            # this step's record, for a hypothesis ending here


@dataclass
class Continuation:
    parent: int   # index into the live beams passed to step()
    token: int
    logprob: float


class BeamSearchState:
    def __init__(self, params: BeamSearchParams, eos_token_ids: set[int], max_tokens: int):
        self.params = params
        self.eos_token_ids = set() if params.ignore_eos else set(eos_token_ids)
        self.max_tokens = max_tokens
        self.finished: list[Hypothesis] = []
        self.done = False
        # seq_id -> (top token ids, top logprobs) of live beams waiting for the rest of the group.
        self.pending: dict[int, tuple[list[int], list[float]]] = {}

    @property
    def num_candidates(self) -> int:
        return 2 * self.params.beam_width

    @property
    def num_logprobs(self) -> int:
        """Top tokens a step records: the candidates, or the asked-for logprobs if more (the
        engine resolves -1 to the vocabulary before this state is made)."""
        return max(self.num_candidates, self.params.logprobs or 0)

    def step(self, beams: list[LiveBeam]) -> list[Continuation]:
        """Advance one token; returns the continuations (best first) that stay live."""
        k = self.params.beam_width
        cands = []
        for b, beam in enumerate(beams):
            for tok, lp in zip(beam.top_token_ids, beam.top_logprobs):
                cands.append((beam.cum_logprob + lp, b, tok, lp))
        # Stable: ties keep beam order, then the beam's own (token) order, like a flat top-k.
        cands.sort(key=lambda c: -c[0])
        cands = cands[:self.num_candidates]

        live: list[Continuation] = []
        for rank, (total, b, tok, lp) in enumerate(cands):
            gen_len = len(beams[b].output_tokens) + 1
            hits = tok in self.eos_token_ids or gen_len >= self.max_tokens
            if not hits:
                if len(live) < k:
                    live.append(Continuation(b, tok, lp))
            elif rank < k:
                reason = "stop" if tok in self.eos_token_ids else "length"
                self.finished.append(Hypothesis(beams[b].output_tokens + [tok], total,
                                                total / gen_len ** self.params.length_penalty, reason,
                                                beams[b].steps + [beams[b].step]))
        self.finished.sort(key=lambda h: -h.score)
        del self.finished[k:]
        if len(self.finished) >= k or not live:
            self.done = True
            return []
        return live

    def finish_live(self, beams: list[tuple[list[int], float, list]]) -> None:
        """Close the search early: live beams (tokens, cum_logprob, step records) become "length"
        hypotheses."""
        for tokens, cum, steps in beams:
            self.finished.append(Hypothesis(list(tokens), cum, cum / len(tokens) ** self.params.length_penalty,
                                            "length", list(steps)))
        self.finished.sort(key=lambda h: -h.score)
        del self.finished[self.params.beam_width:]
        self.done = True

    def best(self) -> list[Hypothesis]:
        return list(self.finished)
