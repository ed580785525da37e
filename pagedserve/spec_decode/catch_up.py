"""A draft model's catch-up plan: which requests' unseen tokens one round's forward writes into the
draft's KV, within the target's step budget (spec_decode/draft_model.py, step 1 of a round)."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class CatchUpPlan:
    """One round's catch-up, at most budget tokens: `active` requests (indices, in request order)
    are caught up to their last verified token and get proposals, `ks[i]` of them; `pieces` are
    (request index, start, length) of every request's KV written this round, in request order,
    active ones ending at their last token."""
    active: list[int] = field(default_factory=list)
    ks: dict[int, int] = field(default_factory=dict)
    pieces: list[tuple[int, int, int]] = field(default_factory=list)


def plan_catch_up(unseen: list[tuple[int, int]], budget: int, reserve) -> CatchUpPlan:
    """unseen: per request (start, length) of its tokens the draft has not seen, or None when it
    does not speculate; reserve(i, tokens) gives request i blocks for its first `tokens` positions
    plus its proposals and returns the number of proposals it may make (0: none; -1: no blocks at
    all). The shortest catch-ups go first, so the ordinary decode rows (a few tokens each) always
    fit; a longer one takes what room is left as a piece and no proposal, and finishes in a later
    round: a 100k-token prompt is caught up over rounds of `budget` tokens while it decodes."""
    plan, room = CatchUpPlan(), budget
    for i in sorted((i for i, u in enumerate(unseen) if u is not None), key=lambda i: unseen[i][1]):
        start, length = unseen[i]
        if length <= room:
            k = reserve(i, start + length)
            if k >= 1:
                plan.active.append(i)
                plan.ks[i] = k
                plan.pieces.append((i, start, length))
                room -= length
        elif room > 0 and reserve(i, start + room) >= 0:
            plan.pieces.append((i, start, room))
            room = 0
    plan.active.sort()
    plan.pieces.sort()
    return plan
