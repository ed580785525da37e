"""Per-sequence grammar state: one xgrammar GrammarMatcher per sequence, keyed by seq_id.

Invariant: a sequence's matcher has accepted exactly its first `num_accepted` output tokens, and
catch_up() feeds the rest before anything reads the matcher (a mask, a fork, a termination
check). The state is the engine's, beside the scheduler: preemption by recompute or by swap moves
KV blocks and never touches it (a preempted sequence keeps its output tokens, so its matcher is
already right when it runs again), a fork copies the parent's matcher (GrammarMatcher.fork, a
deep copy) before either appends, and finish / abort frees it.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import xgrammar as xgr

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class SeqGrammar:
    matcher: xgr.GrammarMatcher
    num_accepted: int = 0
    rejected: bool = False      # a token the grammar refused reached it (never expected: the mask forbids it)

    def catch_up(self, output_token_ids: list[int], pending: int | None = None) -> None:
        """Feed the output tokens not yet accepted, then `pending` (a token sampled but not yet
        appended: overlapped steps read it from the device copy before the host appends it)."""
        n = len(output_token_ids)
        while self.num_accepted < n:
            self._accept(output_token_ids[self.num_accepted])
        if pending is not None and self.num_accepted == n:
            self._accept(pending)

    def _accept(self, token: int) -> None:
        self.num_accepted += 1
        if self.rejected or self.matcher.is_terminated():
            return
        if not self.matcher.accept_token(token):
            self.rejected = True
            logger.error("grammar matcher rejected token %d after %d tokens", token, self.num_accepted - 1)

    @property
    def done(self) -> bool:
        """The grammar has closed (its stop token accepted), or it cannot go on."""
        return self.rejected or self.matcher.is_terminated()

    def fork(self) -> "SeqGrammar":
        return SeqGrammar(self.matcher.fork(), self.num_accepted, self.rejected)


class SeqGrammars:
    """seq_id -> SeqGrammar for every live constrained sequence."""

    def __init__(self) -> None:
        self.by_seq: dict[int, SeqGrammar] = {}

    def __contains__(self, seq_id: int) -> bool:
        return seq_id in self.by_seq

    def __len__(self) -> int:
        return len(self.by_seq)

    def get(self, seq_id: int) -> SeqGrammar | None:
        return self.by_seq.get(seq_id)

    def start(self, seq_id: int, compiled: xgr.CompiledGrammar) -> SeqGrammar:
        g = self.by_seq[seq_id] = SeqGrammar(xgr.GrammarMatcher(compiled))
        return g

    def fork(self, parent_id: int, child_id: int) -> None:
        """The child continues from the parent's state; call before either appends a new token."""
        g = self.by_seq.get(parent_id)
        if g is not None:
            self.by_seq[child_id] = g.fork()

    def free(self, seq_id: int) -> None:
        self.by_seq.pop(seq_id, None)
