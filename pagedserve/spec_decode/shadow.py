"""Shadow probes: a host-side proposer's probe, scored against the tokens decoding went on to
produce instead of verified in a step of its own.

Why: the adaptive policy (spec_decode/policy.py) pauses a proposer whose proposals do not pay and
probes it now and then. A probe verified by the target is a synchronous step, 1.2-1.4x an
overlapped one on the H200, and the step after it starts without overlap too: an always-rejected
proposer's probes (5, 5 and 3 in a 128-token run at 1, 8 and 32 decodes) cost 1.023-1.033x
speculation off (ours at e6c6628, benchmarks/results/h200/spec_decode.json). A host-side proposer (spec_decode/proposer.py)
needs no device to propose, so its probe can be taken over the host's histories while the step
stays overlapped, and made and scored a few steps later from the tokens that decoding emitted
meanwhile. The proposals are made over the history a verified probe would have seen (the host's
plus the token in flight when the probe was taken), once that token is on the host: proposals
over the host's stale history alone predict the in-flight token too, a different event (on the
demo model a copy that had just changed course failed such a probe where the verified one paid).

Exact, not an estimate, for a deterministic (one-hot) proposer: speculative sampling emits the
proposed token at a position exactly when it accepts it (a rejection resamples from the residual
(p - q)+, which excludes the proposed token), so the number of proposals a verification would
accept has the same distribution as the length of the common prefix of the proposals and the
tokens decoding produced without them; for a greedy request the two are equal. The yield is then
what a verified probe of k proposals would have yielded: 1 + accepted, averaged over the rows.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace

from pagedserve.spec_decode.proposer import ProposalRequest


class ShadowProbe:
    """A probe's rows, waiting for the tokens that make and then score their proposals.

    rows: seq_id -> (n, request): propose over the first n tokens of the sequence, the history a
    verified probe taken now would see (the host's, plus the token still in flight), with
    request's k and sampling. advance() proposes for a row once its history holds those n tokens,
    drops it if nothing is proposed, and scores it once a later token differs from its proposal or
    every proposed position is known. The probe need not wait for every row: bounds() gives the
    least and the most it can still yield, and the policy decides as soon as its threshold lies
    outside them (a proposal that matched once already pays at batch 1). A row whose sequence is
    no longer running is dropped, and so is every row still unscored after max_steps calls."""

    def __init__(self, k: int, rows: dict[int, tuple[int, ProposalRequest]], max_steps: int) -> None:
        self.k = k
        self.waiting = dict(rows)  # not proposed yet
        self.pending: dict[int, tuple[int, list[int], int]] = {}  # seq_id -> (n, proposals, matched so far)
        self.accepted: list[int] = []  # scored rows' accepted proposals
        self.steps_left = max_steps

    def advance(self, history_of: Callable[[int], Sequence[int] | None],
                propose: Callable[[ProposalRequest], list[int]]) -> None:
        """Propose and score what the histories now allow (history_of(seq_id): prompt + host-known
        output, or None once the sequence is not running; propose: the proposer's ids for one
        request, spec_decode/proposer.py peek_proposals)."""
        for sid, (n, req) in list(self.waiting.items()):
            hist = history_of(sid)
            if hist is None or len(hist) >= n:
                del self.waiting[sid]
            if hist is not None and len(hist) >= n:
                ids = propose(replace(req, token_ids=hist[:n]))
                if ids:
                    self.pending[sid] = (n, ids, 0)
        for sid, (n, ids, _) in list(self.pending.items()):
            hist = history_of(sid)
            if hist is None:
                del self.pending[sid]
                continue
            seen = hist[n:min(len(hist), n + len(ids))]
            same = next((i for i, (a, b) in enumerate(zip(seen, ids)) if a != b), len(seen))
            if same < len(seen) or len(seen) == len(ids):
                self.accepted.append(same)
                del self.pending[sid]
            else:
                self.pending[sid] = (n, ids, same)
        self.steps_left -= 1
        if self.steps_left <= 0:
            self.waiting.clear()
            self.pending.clear()

    @property
    def done(self) -> bool:
        return not self.pending and not self.waiting

    def bounds(self) -> tuple[float, float] | None:
        """(least, most) tokens per row a verified probe would have emitted, given what is known
        (equal once done); None when no row is left to score. A row not proposed for yet counts
        as 0 to k accepted: if it then proposes nothing and leaves, the least can only rise and
        the most only fall, so a decision taken on these bounds stands."""
        n = len(self.accepted) + len(self.pending) + len(self.waiting)
        if not n:
            return None
        scored = sum(self.accepted)
        low = scored + sum(m for _, _, m in self.pending.values())
        high = scored + sum(len(ids) for _, ids, _ in self.pending.values()) + self.k * len(self.waiting)
        return 1.0 + low / n, 1.0 + high / n
