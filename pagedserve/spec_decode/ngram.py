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
    """Proposer (spec_decode/proposer.py) by prompt lookup. Per sequence it keeps the history as
    a growing numpy buffer and appends only the tokens verified since the last step (a sequence's
    verified tokens never change, only grow), so a step costs O(new tokens) on the host before the
    match; finish() drops it.

    has_proposals (the engine's peek, asked nearly every step while nothing matches) does not
    match at all: any match of length >= min_n contains one of exactly min_n ending at the same
    place, so a proposal exists iff the history's last min_n tokens occurred earlier (ending
    before the last token). A per-sequence set of the min_n-grams seen so far, grown by the new
    tokens only, answers that in O(new tokens): at 32 decodes of 128-256-token histories (random
    tokens, no match) the numpy match took ~95 us a step on a 2-core CPU host, the set ~35 us (host
    time an overlapped step must hide)."""

    accepts_token_history = True  # ProposalRequest.token_ids may be a TokenHistory view
    proposes_on_host = True       # has_proposals may peek (spec_decode/proposer.py)

    def __init__(self, prompt_lookup_min: int, prompt_lookup_max: int) -> None:
        if not 1 <= prompt_lookup_min <= prompt_lookup_max:
            raise ValueError(f"need 1 <= prompt_lookup_min <= prompt_lookup_max, got "
                             f"{prompt_lookup_min}, {prompt_lookup_max}")
        self.min_n, self.max_n = prompt_lookup_min, prompt_lookup_max
        self._history: dict[int, tuple[np.ndarray, int]] = {}  # seq_id -> (buffer, tokens in it)
        # seq_id -> (min_n-grams ending at positions < upto, upto); a gram is the token itself
        # when min_n is 1, else a tuple
        self._seen: dict[int, tuple[set, int]] = {}

    def _tokens(self, r: ProposalRequest) -> np.ndarray:
        n = len(r.token_ids)
        buf, have = self._history.get(r.seq_id, (None, 0))
        if buf is None or have > n:  # unknown, or not a continuation: start again
            buf, have = np.empty(max(16, 2 * n), dtype=np.int64), 0
        if n > buf.shape[0]:
            grown = np.empty(2 * n, dtype=np.int64)
            grown[:have] = buf[:have]
            buf = grown
        if n > have:
            buf[have:n] = r.token_ids[have:n]
        self._history[r.seq_id] = (buf, n)
        return buf[:n]

    def propose(self, requests: list[ProposalRequest]) -> Proposals:
        out = []
        for r in requests:
            out.append(ngram_propose(self._tokens(r), self.min_n, self.max_n, r.num_speculative_tokens).tolist())
        return Proposals(out, None)

    def has_proposals(self, requests: list[ProposalRequest]) -> bool:
        """Whether propose(requests) would give any request a token (see the class docstring).
        Safe on a stale history: the per-sequence set only ever holds grams of verified tokens,
        and a later, longer history of the same sequence continues it."""
        return any(r.num_speculative_tokens >= 1 and self._last_gram_seen(r) for r in requests)

    def peek_proposals(self, requests: list[ProposalRequest]) -> list[list[int]]:
        """What propose(requests) would give (spec_decode/proposer.py: a shadow probe's), with the
        gram index first: the match runs only for a history whose last min_n tokens recur."""
        return [ngram_propose(self._tokens(r), self.min_n, self.max_n, r.num_speculative_tokens).tolist()
                if r.num_speculative_tokens >= 1 and self._last_gram_seen(r) else [] for r in requests]

    def _last_gram_seen(self, r: ProposalRequest) -> bool:
        m, n = self.min_n, len(r.token_ids)
        if n < m + 1:
            return False
        seen, upto = self._seen.get(r.seq_id, (None, 0))
        if seen is None or upto > n - 1:  # unknown, or not a continuation: start again
            seen, upto = set(), 0
        # Index the grams ending at upto .. n - 2 (earlier than the last token), then look up the
        # one ending at n - 1: one slice of the history covers both.
        lo = max(upto, m - 1)
        tail = r.token_ids[lo - m + 1:n]
        if m == 1:
            seen.update(tail[:-1])
            last = tail[-1]
        else:
            seen.update(tuple(tail[i:i + m]) for i in range(len(tail) - m))
            last = tuple(tail[-m:])
        self._seen[r.seq_id] = (seen, n - 1)
        return last in seen

    def finish(self, seq_id: int) -> None:
        self._history.pop(seq_id, None)
        self._seen.pop(seq_id, None)
