"""The vectorised n-gram matcher against a plain brute-force reference."""
import random

import numpy as np
import pytest

from pagedserve.spec_decode.ngram import NgramProposer, ngram_propose
from pagedserve.spec_decode.proposer import ProposalRequest


def brute_force(t: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    L = len(t)
    for n in range(max_n, min_n - 1, -1):
        if n >= L:
            continue
        suffix = t[L - n:]
        for i in range(0, L - n):
            if t[i:i + n] == suffix:
                return t[i + n:i + n + k]
    return []


@pytest.mark.parametrize("vocab", [2, 3, 8])
def test_matches_brute_force(vocab):
    rng = random.Random(vocab)
    for _ in range(400):
        t = [rng.randrange(vocab) for _ in range(rng.randrange(0, 40))]
        lo = rng.randint(1, 4)
        hi = rng.randint(lo, 6)
        k = rng.randint(1, 6)
        got = ngram_propose(np.asarray(t, dtype=np.int64), lo, hi, k).tolist()
        assert got == brute_force(t, lo, hi, k), (t, lo, hi, k)


def test_copy_prompt_proposes_the_continuation():
    passage = list(range(100, 130))
    t = passage + [7, 8] + passage[:10]
    p = NgramProposer(1, 4).propose([ProposalRequest(0, t, 5, 0.0, None)])
    assert p.token_ids == [passage[10:15]] and p.draft_probs is None


def test_no_match_proposes_nothing():
    assert NgramProposer(2, 3).propose([ProposalRequest(0, [1, 2, 3, 4], 3, 0.0, None)]).token_ids == [[]]


def test_incremental_history_matches_fresh_matching():
    """The proposer's per-sequence buffer, fed a growing TokenHistory step by step (as the engine
    does), proposes what a fresh match over the whole history proposes; finish() forgets it."""
    from pagedserve.spec_decode.proposer import TokenHistory
    rng = random.Random(5)
    prop = NgramProposer(1, 3)
    prompt = [rng.randrange(4) for _ in range(20)]
    output: list[int] = []
    for _ in range(60):
        hist = TokenHistory(prompt, output)
        assert list(hist) == prompt + output and hist[3:25] == (prompt + output)[3:25]
        got = prop.propose([ProposalRequest(9, hist, 4, 0.0, None)]).token_ids[0]
        assert got == brute_force(prompt + output, 1, 3, 4)
        output.extend(rng.randrange(4) for _ in range(rng.randint(1, 5)))
    prop.finish(9)
    assert 9 not in prop._history


@pytest.mark.parametrize("lo,hi,vocab", [(1, 5, 40), (2, 3, 6), (3, 4, 3)])
def test_peek_over_stale_histories_agrees_and_leaves_proposals_unchanged(lo, hi, vocab):
    """has_proposals (the engine's peek, spec_decode/proposer.py; its own gram index, not the
    match) says whether propose would give anything, here over a history one token stale, then
    the fresh one, as the engine asks with a step in flight, and sometimes over both the fresh
    one and a longer one (several tokens a step); the proposals match a fresh brute-force match
    all along."""
    from pagedserve.spec_decode.proposer import TokenHistory, proposes_on_host
    rng = random.Random(7 + lo)
    prop = NgramProposer(lo, hi)
    assert proposes_on_host(prop)
    prompt = [rng.randrange(vocab) for _ in range(rng.randrange(0, 12))]
    output: list[int] = []
    for _ in range(80):
        output.extend(rng.randrange(vocab) for _ in range(rng.choice([1, 1, 1, 3])))
        stale = TokenHistory(prompt, output[:-1])
        assert prop.has_proposals([ProposalRequest(3, stale, 4, 0.0, None)]) == \
            bool(brute_force(prompt + output[:-1], lo, hi, 4))
        fresh = ProposalRequest(3, TokenHistory(prompt, output), 4, 0.0, None)
        assert prop.has_proposals([fresh]) == bool(brute_force(prompt + output, lo, hi, 4))
        assert prop.peek_proposals([stale_req := ProposalRequest(3, stale, 4, 0.0, None)]) == \
            [brute_force(list(stale_req.token_ids), lo, hi, 4)]
        assert prop.propose([fresh]).token_ids[0] == brute_force(prompt + output, lo, hi, 4)
    # Not a continuation (a shorter history under the same id): the index starts again.
    short = prompt + output[:lo]
    assert prop.has_proposals([ProposalRequest(3, short, 4, 0.0, None)]) == bool(brute_force(short, lo, hi, 4))
    assert not prop.has_proposals([ProposalRequest(4, [1, 1, 1, 1], 0, 0.0, None)])  # k = 0
    prop.finish(3)
    assert 3 not in prop._seen and 3 not in prop._history
    prop = NgramProposer(2, 3)
    assert prop.has_proposals([ProposalRequest(1, [1, 2, 3], 2, 0.0, None),
                               ProposalRequest(2, [5, 6, 5, 6], 2, 0.0, None)])
    assert not prop.has_proposals([ProposalRequest(1, [1, 2, 3], 2, 0.0, None)])
