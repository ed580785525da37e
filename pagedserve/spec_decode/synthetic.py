"""Benchmark-only proposers: speculation with a chosen acceptance rate, to measure the mechanism.

Real acceptance needs real weights; the benchmarks run dummy weights. So they take proposals
that the target would accept (a draft equal to the target, greedy; or a replay of the target's
own greedy output) and corrupt each proposed token with probability 1 - a. Greedy verification
then accepts a proposal exactly when it and every one before it were left alone: the chance that
proposal j is accepted is a**j, and the expected acceptance rate (accepted / proposed, vLLM's
definition) is (a + a**2 + ... + a**k) / k. The benchmark records the measured rate beside a.

Not for serving: the corruption throws away a draft's work on purpose, and only greedy requests
are allowed (a corrupted token must not pretend to come from the draft's distribution).
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

from pagedserve.spec_decode.proposer import ProposalRequest, Proposals, Proposer, proposes_on_host


class AcceptanceControlledProposer:
    """Wraps a proposer whose greedy proposals the target accepts, and replaces each proposed
    token by another id with probability 1 - acceptance (a numpy generator seeded once: the
    same run corrupts the same tokens)."""

    def __init__(self, inner: Proposer, acceptance: float, vocab_size: int, seed: int = 0):
        if not 0.0 <= acceptance <= 1.0:
            raise ValueError(f"acceptance must be in [0, 1], got {acceptance}")
        if vocab_size < 2:
            raise ValueError(f"vocab_size must be >= 2, got {vocab_size}")
        self.inner, self.acceptance, self.vocab_size = inner, acceptance, vocab_size
        self.rng = np.random.default_rng(seed)
        self.peek_rng = np.random.default_rng(seed + 1)  # peeks draw apart: a run's proposals stay

    @property
    def proposes_on_host(self) -> bool:
        """The inner proposer's (spec_decode/proposer.py): corrupting is host work."""
        return proposes_on_host(self.inner)

    def has_proposals(self, requests: list[ProposalRequest]) -> bool:
        """The inner proposer's answer (corruption keeps every proposal's length); the corruption
        generator is not touched, so a peek leaves the run's corrupted tokens as they were."""
        return self.inner.has_proposals(requests)

    def peek_proposals(self, requests: list[ProposalRequest]) -> list[list[int]]:
        """The inner proposer's, corrupted alike from a generator of their own (so a peek leaves
        the run's corrupted tokens as they were)."""
        return [self._corrupt(ids, self.peek_rng) for ids in self.inner.peek_proposals(requests)]

    def _corrupt(self, ids, rng: np.random.Generator) -> list[int]:
        ids = np.asarray(ids, dtype=np.int64)
        hit = rng.random(ids.shape[0]) >= self.acceptance
        # Shift by 1..vocab-1: always another id, uniformly among the others.
        shift = rng.integers(1, self.vocab_size, size=ids.shape[0])
        return np.where(hit, (ids + shift) % self.vocab_size, ids).tolist()

    def propose(self, requests: list[ProposalRequest]) -> Proposals:
        for r in requests:
            if r.temperature > 0:
                raise ValueError("AcceptanceControlledProposer is for greedy benchmark requests only "
                                 f"(sequence {r.seq_id} has temperature {r.temperature})")
        got = self.inner.propose(requests)
        return Proposals([self._corrupt(ids, self.rng) for ids in got.token_ids], None)

    def finish(self, seq_id: int) -> None:
        self.inner.finish(seq_id)


class ReplayProposer:
    """Proposes the target's own greedy continuation, read from recorded sequences (prompt +
    output of a run without speculation): a free, perfect draft that isolates the cost of
    verification. A history that no recording starts with (greedy output changed) gets nothing,
    then and for the rest of its sequence (it is not searched again)."""

    proposes_on_host = True  # has_proposals may peek (spec_decode/proposer.py)

    def __init__(self, recordings: Sequence[Sequence[int]]):
        self.recordings = [np.asarray(r, dtype=np.int64) for r in recordings]
        self.by_seq: dict[int, np.ndarray | None] = {}  # None: diverged from every recording
        # seq_id -> (tokens compared, recordings whose prefix equals them): a longer history of the
        # same sequence can only follow one of these, so each call compares the new tokens alone
        # (a peek every step at 32 decodes compared whole histories with every recording).
        self._consistent: dict[int, tuple[int, list[int]]] = {}

    def _find(self, r: ProposalRequest) -> np.ndarray | None:
        """The first recording that r's history is a proper prefix of (None: none)."""
        n = len(r.token_ids)
        seen, cands = self._consistent.get(r.seq_id, (0, None))
        if cands is None or seen > n:  # unknown, or not a continuation: every recording again
            seen, cands = 0, list(range(len(self.recordings)))
        tail = np.asarray(r.token_ids[seen:n], dtype=np.int64)
        cands = [i for i in cands if self.recordings[i].shape[0] >= n
                 and np.array_equal(self.recordings[i][seen:n], tail)]
        self._consistent[r.seq_id] = (n, cands)
        return next((self.recordings[i] for i in cands if self.recordings[i].shape[0] > n), None)

    def _recording(self, r: ProposalRequest) -> np.ndarray | None:
        """The recording r's sequence follows (None: none); which one it is stays undecided until
        propose() (two recordings may share a prefix)."""
        n = len(r.token_ids)
        rec = self.by_seq[r.seq_id] if r.seq_id in self.by_seq else self._find(r)
        if rec is not None and (rec.shape[0] <= n or rec[n - 1] != r.token_ids[-1]):
            return None
        return rec

    def propose(self, requests: list[ProposalRequest]) -> Proposals:
        out = []
        for r in requests:
            n = len(r.token_ids)
            rec = self.by_seq[r.seq_id] = self._recording(r)
            out.append([] if rec is None else rec[n:n + r.num_speculative_tokens].tolist())
        return Proposals(out, None)

    def has_proposals(self, requests: list[ProposalRequest]) -> bool:
        """Whether propose(requests) would give any request a token; picks no recording (a stale
        history must not pick the one that a later, longer one decides), only narrows the ones
        the sequence can still follow."""
        return any(self._recording(r) is not None for r in requests)

    def peek_proposals(self, requests: list[ProposalRequest]) -> list[list[int]]:
        """What propose(requests) would give, remembering nothing (as has_proposals)."""
        out = []
        for r in requests:
            rec, n = self._recording(r), len(r.token_ids)
            out.append([] if rec is None else rec[n:n + r.num_speculative_tokens].tolist())
        return out

    def finish(self, seq_id: int) -> None:
        self.by_seq.pop(seq_id, None)
        self._consistent.pop(seq_id, None)
