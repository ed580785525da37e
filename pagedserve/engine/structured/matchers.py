"""Per-sequence grammar state: one xgrammar GrammarMatcher per sequence, keyed by seq_id.

Invariant: a sequence's matcher has accepted exactly its first `num_accepted` output tokens, and
catch_up() (one sequence) or SeqGrammars.advance() (a step's rows at once) feeds the rest before
anything reads the matcher (a mask, a fork, a termination check). The state is the engine's,
beside the scheduler: preemption by recompute or by swap moves KV blocks and never touches it (a
preempted sequence keeps its output tokens, so its matcher is already right when it runs again), a
fork copies the parent's matcher (GrammarMatcher.fork, a deep copy) before either appends, and
finish / abort frees it.

`done` is kept in Python beside the matcher so that the per-step paths never ask xgrammar for it:
a matcher built with xgrammar's default terminate_without_stop_token=False terminates only by
accepting one of its stop tokens, so it is looked up (is_terminated) only after such a token.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import xgrammar as xgr

logger = logging.getLogger(__name__)

_batch_accept = xgr.BatchGrammarMatcher.batch_accept_token


@dataclass(slots=True)
class SeqGrammar:
    matcher: xgr.GrammarMatcher
    stop_token_ids: frozenset[int]  # the tokens whose acceptance can terminate the matcher
    num_accepted: int = 0
    # a token the grammar refused reached it: only when its mask left the draw no token (the
    # request's allowed_token_ids / bad_words / min_tokens exclude all it accepts, or a dead end)
    rejected: bool = False
    done: bool = False          # the grammar has closed (its stop token accepted), or it cannot go on

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
        if self.done:
            return
        self._accepted(token, self.matcher.accept_token(token))

    def _accepted(self, token: int, ok: bool) -> None:
        """The matcher's answer to `token` (num_accepted already counts it)."""
        if not ok:
            self.rejected = self.done = True
            logger.warning("grammar matcher rejected token %d after %d tokens", token, self.num_accepted - 1)
        elif token in self.stop_token_ids:
            self.done = self.matcher.is_terminated()

    def fork(self) -> "SeqGrammar":
        return SeqGrammar(self.matcher.fork(), self.stop_token_ids, self.num_accepted, self.rejected, self.done)


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
        matcher = xgr.GrammarMatcher(compiled)
        g = self.by_seq[seq_id] = SeqGrammar(matcher, frozenset(matcher.stop_token_ids))
        return g

    def fork(self, parent_id: int, child_id: int) -> None:
        """The child continues from the parent's state; call before either appends a new token."""
        g = self.by_seq.get(parent_id)
        if g is not None:
            self.by_seq[child_id] = g.fork()

    def free(self, seq_id: int) -> None:
        self.by_seq.pop(seq_id, None)

    @staticmethod
    def advance(rows: list[tuple[SeqGrammar, list[int], int | None]]) -> None:
        """catch_up(output_token_ids, pending) for every (grammar, output_token_ids, pending) row,
        with one xgrammar call for the usual case, a row exactly one token behind (the token the
        previous step sampled): Python pays one loop over the rows instead of a method call and an
        xgrammar call per row. Rows further behind (never in a steady decode) catch up one by one."""
        matchers, tokens, grammars = [], [], []
        for g, out, pending in rows:
            n = len(out)
            behind = n - g.num_accepted
            if behind == 0:
                if pending is None:
                    continue
                token = pending
            elif behind == 1 and pending is None:
                token = out[-1]
            else:
                g.catch_up(out, pending)
                continue
            g.num_accepted += 1
            if not g.done:
                matchers.append(g.matcher)
                tokens.append(token)
                grammars.append(g)
        if not matchers:
            return
        if len(matchers) == 1:
            grammars[0]._accepted(tokens[0], matchers[0].accept_token(tokens[0]))
            return
        for g, token, ok in zip(grammars, tokens, _batch_accept(matchers, tokens)):
            if not ok or token in g.stop_token_ids:
                g._accepted(token, ok)
