"""The rejection sampler keeps the target distribution: chi-square tests over many draws.

Critical value: scipy.stats.chi2.ppf(1 - 0.001, dof) (scipy is in the venv), i.e. a correct
sampler fails a test 1 time in 1000; every draw is seeded, so the suite is deterministic.
"""
import pytest
import torch
from scipy.stats import chi2

from pagedserve.spec_decode.rejection import VerifyRow, rejection_sample

V = 5


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> tuple[float, int]:
    n = counts.sum()
    keep = probs > 0
    expected = probs[keep] * n
    assert counts[~keep].sum() == 0, "a token of probability 0 was emitted"
    stat = ((counts[keep] - expected) ** 2 / expected).sum().item()
    return stat, int(keep.sum()) - 1


def run(p: torch.Tensor, q: torch.Tensor | None, n: int, seed: int):
    """n requests, k = p.shape[0] - 1 drafts each drawn from q (or, one-hot, each position's
    target argmax, so that enough requests reach the second position)."""
    k = p.shape[0] - 1
    g = torch.Generator().manual_seed(seed)
    if q is None:
        drafts = p[:k].argmax(dim=1).repeat(n, 1)
        draft_probs = None
    else:
        drafts = torch.stack([torch.multinomial(q[j], n, replacement=True, generator=g) for j in range(k)], 1)
        draft_probs = q[:k].repeat(n, 1)
    rows = [VerifyRow(drafts[i].tolist(), False, None) for i in range(n)]
    target = p.repeat(n, 1)
    return rejection_sample(target, rows, draft_probs, g), drafts


SHARP = [
    # target, draft: mostly disagreeing, and a draft putting mass where the target has none
    (torch.tensor([0.6, 0.3, 0.05, 0.05, 0.0]), torch.tensor([0.0, 0.05, 0.05, 0.1, 0.8])),
    (torch.tensor([0.2, 0.2, 0.2, 0.2, 0.2]), torch.tensor([0.96, 0.01, 0.01, 0.01, 0.01])),
    (torch.tensor([0.01, 0.01, 0.01, 0.01, 0.96]), torch.tensor([0.25, 0.25, 0.25, 0.25, 0.0])),
]


@pytest.mark.parametrize("case", range(len(SHARP)))
@pytest.mark.parametrize("one_hot", [False, True])
def test_each_emitted_position_follows_the_target(case, one_hot):
    p0, q0 = SHARP[case]
    p = torch.stack([p0, p0.flip(0), (p0 + 0.1) / (p0 + 0.1).sum()])  # 3 positions: k = 2
    q = None if one_hot else torch.stack([q0, q0.flip(0)])
    n = 20000
    res, _ = run(p, q, n, seed=case)
    first = torch.bincount(torch.tensor([t[0] for t in res.token_ids]), minlength=V).double()
    stat, dof = chi_square(first, p[0].double())
    assert stat < chi2.ppf(0.999, dof), (stat, first)
    # Given the first draft was accepted, the second emitted token follows p_1 (drafts are independent).
    second = [t[1] for t in res.token_ids if len(t) >= 2]
    assert len(second) > 400  # about n x overlap(p_0, q_0): 800 for the sharpest case
    counts = torch.bincount(torch.tensor(second), minlength=V).double()
    stat, dof = chi_square(counts, p[1].double())
    assert stat < chi2.ppf(0.999, dof), (stat, counts)


def test_acceptance_rate_is_the_overlap():
    """P(accept d_1) = sum_x min(p(x), q(x)) (Leviathan et al., Theorem 3.5)."""
    p0, q0 = SHARP[0]
    p = torch.stack([p0, p0])
    res, _ = run(p, q0[None], 20000, seed=7)
    rate = sum(res.num_accepted) / 20000
    expected = torch.minimum(p0, q0).sum().item()
    assert abs(rate - expected) < 4 * (expected * (1 - expected) / 20000) ** 0.5 + 1e-9


def test_greedy_accepts_argmax_prefix_and_emits_argmax():
    logits = torch.tensor([[0.0, 5.0, 1.0], [3.0, 0.0, 1.0], [0.0, 0.0, 9.0], [1.0, 2.0, 0.0]])
    rows = [VerifyRow([1, 0, 1], True, None)]  # argmaxes are 1, 0, 2, 1: the third draft is wrong
    res = rejection_sample(logits, rows, None, torch.Generator().manual_seed(0))
    assert res.token_ids == [[1, 0, 2]] and res.num_accepted == [2]
    rows = [VerifyRow([1, 0, 2], True, None)]
    assert rejection_sample(logits, rows, None, torch.Generator()).token_ids == [[1, 0, 2, 1]]


def test_seeded_rows_do_not_depend_on_the_batch():
    p = torch.tensor([[0.3, 0.3, 0.4], [0.5, 0.25, 0.25], [0.1, 0.1, 0.8]])
    q = torch.tensor([[0.1, 0.8, 0.1], [0.3, 0.3, 0.4]])

    def seeded():
        return VerifyRow([1, 2], False, torch.Generator().manual_seed(123))
    alone = rejection_sample(p, [seeded()], q, torch.Generator().manual_seed(1)).token_ids[0]
    other = VerifyRow([0, 0], False, None)
    batched = rejection_sample(torch.cat([p, p]), [other, seeded()], torch.cat([q, q]),
                               torch.Generator().manual_seed(99)).token_ids[1]
    assert alone == batched


def test_no_drafts_is_a_plain_draw():
    res = rejection_sample(torch.tensor([[0.0, 1.0, 0.0]]), [VerifyRow([], False, None)], None, torch.Generator())
    assert res.token_ids == [[1]] and res.num_accepted == [0]
