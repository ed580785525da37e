"""vLLM's Logprob objects, and the plain numbers the engine computes them from.

`CompletionOutput.logprobs` and `RequestOutput.prompt_logprobs` hold, per position, a dict
token id -> Logprob, as vLLM's do (`vllm.logprobs.Logprob`, formerly `vllm.sequence.Logprob`):
the chosen token (the sampled one, or the prompt's own) first, then the top-N by probability.

The engine computes a position as plain numbers (PositionLogprobs: ids, logprobs, the chosen
token's rank). That is what crosses from the engine core to the API server (msgpack), and only
the front end (the in-process OutputProcessor, or the server's RequestText) makes the dicts,
naming the tokens with its tokenizer (engine/logprob_tokens.py).
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Iterable

import msgspec


@dataclass
class Logprob:
    """One token's logprob at one position; vLLM's fields and defaults.

    logprob: the model's raw log_softmax (vLLM's default logprobs mode, before any sampling
        setting), the same value cumulative_logprob sums for a chosen token.
    rank: 1 is the most likely token. A chosen token's is the number of tokens at least as
        likely as it (a tie counts every tied token, vLLM's `>=` count); the top-N are 1..N in
        order, and a chosen token among them takes its place there, as in vLLM.
    decoded_token: the token's text on its own (engine/logprob_tokens.py); None without a
        tokenizer.
    """
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


class PositionLogprobs(msgspec.Struct, array_like=True, gc=False):
    """One position as the sampler (or the prompt-logprob pass) computes it: plain numbers only,
    so it crosses the engine core's socket as a 3-element array. gc=False: it holds no objects
    that could form a cycle."""
    token_ids: list[int]   # [chosen, top 1, ..., top N]; the chosen one may be among the top too
    logprobs: list[float]  # alike; a chosen token among the top carries the same value there
    rank: int              # the chosen token's rank in the vocabulary (Logprob.rank)


def logprob_dict(p: PositionLogprobs, texts: Iterable[str | None] | None = None) -> dict[int, Logprob]:
    """vLLM's dict of one position (vllm.logprobs.append_logprobs_for_next_position): the chosen
    token first with its rank, then the top-N with ranks 1..N; a chosen token that is also in
    the top-N keeps its first place and takes the later entry's rank (the same key written twice)."""
    ranks = itertools.chain((p.rank,), range(1, len(p.token_ids)))
    names = itertools.repeat(None) if texts is None else texts
    return {t: Logprob(lp, r, s) for t, lp, r, s in zip(p.token_ids, p.logprobs, ranks, names)}
