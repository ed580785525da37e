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
