"""N-gram (prompt lookup) proposer: no model, only the request's own tokens.

For a history t (prompt + verified output), find the longest n in [min_n, max_n] such that the
last n tokens also occur earlier in t, take the earliest such occurrence, and propose the (up to
k) tokens that followed it. Copy-heavy requests (repeat, edit, quote a passage) accept most of
them; others get no proposal and decode as usual.

The matcher is vectorised numpy: one comparison of the whole history with the last token gives
the candidate positions, then max_n - 1 comparisons over the candidates only grow each match
backwards. No Python loop runs over tokens; the loops are over n (at most max_n) and requests.
Deterministic: Proposals.draft_probs is None (a one-hot draft distribution).
"""
from __future__ import annotations

import numpy as np

from pagedserve.spec_decode.proposer import ProposalRequest, Proposals


def ngram_propose(tokens: np.ndarray, min_n: int, max_n: int, k: int) -> np.ndarray:
    """The (up to k) tokens after the earliest earlier occurrence of the longest suffix of
    `tokens` of length in [min_n, max_n]; empty when there is none."""
    L = tokens.shape[0]
    if L < min_n + 1 or k < 1:
        return tokens[:0]
    # Candidate ends j (< L - 1: the suffix itself ends at L - 1 and needs a token after it).
    ends = np.flatnonzero(tokens[:L - 1] == tokens[L - 1])
    if ends.size == 0:
        return tokens[:0]
    length = np.ones(ends.size, dtype=np.int64)
    alive = np.ones(ends.size, dtype=bool)
    for d in range(1, max_n):
        # Grow matches still alive by one token backwards, where the history allows.
        ok = alive & (ends - d >= 0)
        idx = np.flatnonzero(ok)
        if idx.size == 0:
            break
        same = tokens[ends[idx] - d] == tokens[L - 1 - d]
        length[idx[same]] += 1
        alive[:] = False
        alive[idx[same]] = True
    best = int(length.max())
    if best < min_n:
        return tokens[:0]
    j = int(ends[np.argmax(length == best)])  # the earliest of the longest
    return tokens[j + 1:j + 1 + k]


class NgramProposer:
    """Proposer (spec_decode/proposer.py) by prompt lookup; holds no per-sequence state."""

    def __init__(self, prompt_lookup_min: int, prompt_lookup_max: int) -> None:
        if not 1 <= prompt_lookup_min <= prompt_lookup_max:
            raise ValueError(f"need 1 <= prompt_lookup_min <= prompt_lookup_max, got "
                             f"{prompt_lookup_min}, {prompt_lookup_max}")
        self.min_n, self.max_n = prompt_lookup_min, prompt_lookup_max

    def propose(self, requests: list[ProposalRequest]) -> Proposals:
        out = []
        for r in requests:
            t = np.asarray(r.token_ids, dtype=np.int64)
            out.append(ngram_propose(t, self.min_n, self.max_n, r.num_speculative_tokens).tolist())
        return Proposals(out, None)

    def finish(self, seq_id: int) -> None:
        pass
