"""The rejection sampler keeps the target distribution: chi-square tests over many draws.

Critical value: the chi-square quantile at 1 - 0.001 for the test's degrees of freedom
(scipy.stats.chi2.ppf where scipy is installed, else the tabulated values: dof 1-4 give 10.828,
13.816, 16.266, 18.467), i.e. a correct sampler fails a test 1 time in 1000; every draw is seeded,
so the suite is deterministic.
"""
import pytest
import torch

try:
    from scipy.stats import chi2
    critical = lambda dof: chi2.ppf(0.999, dof)  # noqa: E731
except ImportError:  # the tabulated chi-square critical values at p = 0.001
    critical = {1: 10.828, 2: 13.816, 3: 16.266, 4: 18.467}.__getitem__

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
    assert stat < critical(dof), (stat, first)
    # Given the first draft was accepted, the second emitted token follows p_1 (drafts are independent).
    second = [t[1] for t in res.token_ids if len(t) >= 2]
    assert len(second) > 400  # about n x overlap(p_0, q_0): 800 for the sharpest case
    counts = torch.bincount(torch.tensor(second), minlength=V).double()
    stat, dof = chi_square(counts, p[1].double())
    assert stat < critical(dof), (stat, counts)


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


def _mixed_batch(device: str):
    """Greedy, sampled and seeded rows, k = 3, 0, 2, 3 (the greedy row's third draft is wrong)."""
    g = torch.Generator(device=device).manual_seed(5)
    V = 11
    ks = [3, 0, 2, 3]
    logits = torch.randn(sum(ks) + len(ks), V, generator=g, device=device) * 3
    probs = logits.softmax(dim=-1)
    am = logits.argmax(dim=-1).tolist()
    draft_probs = torch.rand(sum(ks), V, generator=g, device=device).softmax(dim=-1)
    rows = [VerifyRow([am[0], am[1], (am[2] + 1) % V], True, None),
            VerifyRow([], False, None),
            VerifyRow([3, 4], False, None),
            VerifyRow([1, 2, 3], False, torch.Generator(device=device).manual_seed(9))]
    return logits, probs, rows, draft_probs, ks, am


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA"))])
def test_one_read_per_verification_with_the_emitted_tokens_logprobs(monkeypatch, device):
    """A batch of greedy, sampled and seeded rows is verified with one host read (rejection.to_host:
    accepted counts, final tokens and logprobs together; on CUDA no other sync, which
    set_sync_debug_mode("error") would raise on); the greedy row follows the argmax rule, and each
    emitted token's logprob is log_softmax(logits) at its position."""
    from pagedserve.spec_decode import rejection
    from spec_decode.host_reads import count_reads

    logits, probs, rows, draft_probs, ks, am = _mixed_batch(device)
    shared = torch.Generator(device=device).manual_seed(1)
    if device == "cuda":
        read = rejection.to_host

        def allowed_read(t):
            torch.cuda.set_sync_debug_mode(0)
            try:
                return read(t)
            finally:
                torch.cuda.set_sync_debug_mode("error")
        monkeypatch.setattr(rejection, "to_host", allowed_read)
        rejection_sample(probs, rows, draft_probs, shared, logits=logits)  # first use may sync
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
    try:
        with count_reads(("pagedserve.spec_decode",)) as reads:
            res = rejection_sample(probs, rows, draft_probs, shared, logits=logits)
    finally:
        if device == "cuda":
            torch.cuda.set_sync_debug_mode(0)
    if device == "cpu":
        assert dict(reads) == {("pagedserve.spec_decode.rejection", "tolist"): 1}
    assert res.token_ids[0] == [am[0], am[1], am[2]] and res.num_accepted[0] == 2
    ref = logits.log_softmax(dim=-1).cpu()
    start = 0
    for toks, k, lps, a in zip(res.token_ids, ks, res.logprobs, res.num_accepted):
        assert len(toks) == len(lps) == a + 1
        want = [ref[start + j, t].item() for j, t in enumerate(toks)]
        assert lps == pytest.approx(want, abs=1e-5)
        start += k + 1
