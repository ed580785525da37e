"""The benchmark-only proposers: corruption at the chosen rate, and replay of recorded output."""
from __future__ import annotations

import pytest

from pagedserve.spec_decode.proposer import ProposalRequest
from pagedserve.spec_decode.synthetic import AcceptanceControlledProposer, ReplayProposer

REC = [list(range(10, 40)), [7, 7, 7] + list(range(100, 130))]


def req(seq_id, tokens, k, temperature=0.0):
    return ProposalRequest(seq_id, list(tokens), k, temperature, None)


def test_replay_proposes_the_recorded_continuation():
    p = ReplayProposer(REC)
    got = p.propose([req(0, REC[0][:5], 4), req(1, REC[1][:4], 3), req(2, [1, 2, 3], 2), req(3, REC[0][:28], 4)])
    assert got.token_ids == [REC[0][5:9], REC[1][4:7], [], REC[0][28:30]]
    assert got.draft_probs is None
    # A sequence that left its recording gets nothing from then on.
    assert p.propose([req(0, REC[0][:6] + [999], 4)]).token_ids == [[]]
    assert p.propose([req(0, REC[0][:6] + [999, 16], 4)]).token_ids == [[]]
    p.finish(0)
    assert p.propose([req(0, REC[0][:3], 2)]).token_ids == [REC[0][3:5]]


@pytest.mark.parametrize("a", [0.0, 0.5, 1.0])
def test_corruption_rate(a):
    vocab = 50
    p = AcceptanceControlledProposer(ReplayProposer(REC), a, vocab, seed=3)
    kept = total = 0
    for step in range(300):
        got = p.propose([req(step, REC[0][:5], 4)]).token_ids[0]
        kept += sum(x == y for x, y in zip(got, REC[0][5:9]))
        total += 4
        assert all(0 <= x < vocab for x in got)
    if a in (0.0, 1.0):
        assert kept == a * total
    else:  # 1200 Bernoulli(0.5) draws: within 5 standard deviations (0.072)
        assert abs(kept / total - a) < 0.072


def test_corruption_refuses_sampled_requests():
    p = AcceptanceControlledProposer(ReplayProposer(REC), 0.5, 50)
    with pytest.raises(ValueError, match="greedy"):
        p.propose([req(0, REC[0][:5], 2, temperature=0.5)])
    with pytest.raises(ValueError, match="acceptance"):
        AcceptanceControlledProposer(ReplayProposer(REC), 1.5, 50)
