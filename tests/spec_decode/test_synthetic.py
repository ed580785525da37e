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


def test_peek_remembers_nothing_and_draws_nothing():
    """has_proposals (the engine's peek): the replay answers without remembering which recording a
    (stale) history follows; the corruption wrapper forwards it without drawing from its generator,
    so a run with peeks corrupts the same tokens as one without."""
    from pagedserve.spec_decode.proposer import proposes_on_host
    # Two recordings that share their first 3 tokens: a 3-token history cannot tell them apart.
    recs = [[1, 2, 3, 4, 5, 6], [1, 2, 3, 9, 8, 7]]
    p = ReplayProposer(recs)
    assert proposes_on_host(p) and p.has_proposals([req(0, [1, 2, 3], 2)])
    assert not p.has_proposals([req(5, [4, 4], 2)]) and p.by_seq == {}  # (a sequence's history only grows)
    assert p.propose([req(0, [1, 2, 3, 9], 2)]).token_ids == [[8, 7]]  # the second recording
    assert p.has_proposals([req(0, [1, 2, 3, 9, 8], 2)]) and not p.has_proposals([req(0, [1, 2, 3, 9, 5], 2)])
    assert p.peek_proposals([req(1, [1, 2, 3, 4], 2), req(0, [1, 2, 3, 9, 5], 2)]) == [[5, 6], []]
    assert 1 not in p.by_seq
    wrapped = [AcceptanceControlledProposer(ReplayProposer(REC), 0.5, 50, seed=1) for _ in range(2)]
    assert proposes_on_host(wrapped[0])
    assert not proposes_on_host(AcceptanceControlledProposer(object(), 0.5, 50))  # not host-side inside
    for step in range(20):
        assert wrapped[0].has_proposals([req(step, REC[0][:5], 4)])
        assert not wrapped[0].has_proposals([req(100 + step, [999], 4)])
        # peek_proposals (a shadow probe's) corrupts from a generator of its own, at the same rate.
        peeked = wrapped[0].peek_proposals([req(step, REC[0][:5], 4), req(100 + step, [999], 4)])
        assert len(peeked[0]) == 4 and peeked[1] == []
        assert wrapped[0].propose([req(step, REC[0][:5], 4)]).token_ids == \
            wrapped[1].propose([req(step, REC[0][:5], 4)]).token_ids


def test_replay_narrowing_agrees_with_a_full_search():
    """The replay keeps, per sequence, the recordings its history so far is a prefix of and
    compares only the new tokens each call: over growing histories (one token or several a step,
    following a recording, then leaving it) its answers equal a search of every recording."""
    import random
    rng = random.Random(3)
    recs = [[rng.randrange(3) for _ in range(12)] for _ in range(6)]
    recs += [recs[0][:6] + [7, 7], recs[1][:4]]  # shared prefixes, and a recording that ends early

    def full(h, k):
        rec = next((r for r in recs if len(r) > len(h) and r[:len(h)] == h), None)
        return [] if rec is None else rec[len(h):len(h) + k]
    for trial in range(60):
        p, src = ReplayProposer(recs), rng.choice(recs)
        h = list(src[:rng.randrange(1, 4)])
        while len(h) < 14:
            assert p.peek_proposals([req(trial, list(h), 3)]) == [full(h, 3)], (h, recs)
            assert p.has_proposals([req(trial, list(h), 3)]) == bool(full(h, 3))
            nxt = len(h) + rng.choice([1, 1, 2])
            h = h + (src[len(h):nxt] if rng.random() < 0.85 else [rng.randrange(3)])
