"""Sampler against plain-torch / numpy references of each filter and penalty."""
import numpy as np
import pytest
import torch

from pagedserve.layers.sampler import (Sampler, SampleRow, apply_min_p, apply_penalties,
                                       apply_top_k_top_p, derive_seed)
from pagedserve.sampling_params import SamplingParams

V = 50


def _rows(params, n=None, **kw):
    params = params if isinstance(params, list) else [params] * n
    return [SampleRow(i, p, kw.get("prompt", [1, 2, 3]), kw.get("output", []), kw.get("gen")) for i, p in enumerate(params)]


def _ref_filter(logits: np.ndarray, k: int, p: float, min_p: float) -> np.ndarray:
    """Which tokens survive, computed one row at a time in numpy (float64)."""
    order = np.argsort(-logits, kind="stable")
    keep = np.zeros(len(logits), dtype=bool)
    keep[order[:k if k > 0 else len(logits)]] = True
    x = np.where(keep, logits, -np.inf).astype(np.float64)
    probs = np.exp(x - x.max())
    probs /= probs.sum()
    if p < 1.0:
        mass = 0.0
        kept = np.zeros_like(keep)
        for t in order:
            if not keep[t]:
                break
            kept[t] = True
            mass += probs[t]
            if mass >= p:
                break
        keep = kept
    if min_p > 0:
        x = np.where(keep, logits, -np.inf).astype(np.float64)
        probs = np.exp(x - x.max())
        probs /= probs.sum()
        keep &= probs >= min_p * probs.max()
    return keep


@pytest.mark.parametrize("k,p,min_p", [(5, 1.0, 0.0), (-1, 0.7, 0.0), (10, 0.5, 0.0), (-1, 1.0, 0.1),
                                       (8, 0.9, 0.05), (1, 1.0, 0.0), (-1, 0.01, 0.0)])
def test_filters_keep_exactly_the_reference_set(k, p, min_p):
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(16, V, generator=g) * 3
    x = logits
    kk = torch.full((16,), k if k > 0 else V)
    pp = torch.full((16,), p)
    x = apply_top_k_top_p(x, kk, pp)
    if min_p:
        x = apply_min_p(x, torch.full((16,), min_p))
    for i in range(16):
        ref = _ref_filter(logits[i].double().numpy(), k, p, min_p)
        assert np.array_equal(torch.isfinite(x[i]).numpy(), ref), i
        # Survivors keep their logits unchanged.
        assert torch.equal(x[i][ref], logits[i][ref])


def test_filters_with_mixed_rows_keep_exactly_the_reference_set():
    """One batch mixing top-k rows, top-p-only rows (the bisection path) and unfiltered rows."""
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(12, V, generator=g) * 3
    ks = [5, -1, 10, -1, -1, 3, 8, -1, 1, -1, 20, -1]
    ps = [1.0, 0.7, 0.5, 1.0, 0.95, 0.9, 1.0, 0.3, 1.0, 0.05, 0.8, 0.999]
    x = apply_top_k_top_p(logits, torch.tensor([k if k > 0 else V for k in ks]), torch.tensor(ps))
    for i, (k, p) in enumerate(zip(ks, ps)):
        ref = _ref_filter(logits[i].double().numpy(), k, p, 0.0)
        assert np.array_equal(torch.isfinite(x[i]).numpy(), ref), i
        assert torch.equal(x[i][ref], logits[i][ref])


def test_sampled_distribution_matches_filtered_softmax():
    torch.manual_seed(0)
    logits = torch.randn(V) * 2
    n = 40000
    params = SamplingParams(temperature=0.8, top_k=6, top_p=0.9)
    sampler = Sampler(torch.Generator().manual_seed(0))
    out = sampler.sample(logits.expand(n, V).contiguous(), _rows(params, n))
    counts = np.bincount(out.token_ids, minlength=V) / n
    keep = _ref_filter((logits / 0.8).double().numpy(), 6, 0.9, 0.0)
    x = np.where(keep, (logits / 0.8).double().numpy(), -np.inf)
    ref = np.exp(x - x.max())
    ref /= ref.sum()
    assert (counts[~keep] == 0).all()
    assert np.abs(counts - ref).max() < 0.015


def test_greedy_is_argmax_and_logprobs_are_raw_log_softmax():
    torch.manual_seed(0)
    logits = torch.randn(6, V)
    params = [SamplingParams(temperature=0.0, logprobs=3), SamplingParams(temperature=0.0, logprobs=0),
              SamplingParams(temperature=2.0, logprobs=5, top_k=3)] * 2
    out = Sampler(torch.Generator().manual_seed(0)).sample(logits, _rows(params))
    ref = torch.log_softmax(logits, dim=-1)
    for i, p in enumerate(params):
        tok = out.token_ids[i]
        if p.greedy:
            assert tok == int(logits[i].argmax())
        assert out.logprobs[i] == pytest.approx(float(ref[i, tok]), abs=1e-6)
        pos = out.position_logprobs[i]  # the chosen token first, then the top N in order
        assert pos.token_ids == [tok] + ref[i].topk(p.logprobs).indices.tolist()
        assert pos.logprobs[0] == out.logprobs[i]
        for t, lp in zip(pos.token_ids, pos.logprobs):
            assert lp == pytest.approx(float(ref[i, t]), abs=1e-6)
        assert pos.rank == int((ref[i] > ref[i, tok]).sum()) + 1  # no ties in randn logits


def test_rank_counts_ties_and_only_the_rows_that_ask(monkeypatch):
    """vLLM's rank of the chosen token: how many tokens have a logit >= its own, every tied one
    included; a chosen token among the top N takes its place there. Only rows that ask for
    logprobs are counted (the others cost nothing)."""
    import pagedserve.layers.sampler as sampler_module
    from pagedserve.logprobs import logprob_dict
    logits = torch.zeros(3, V)
    logits[:, [3, 7, 9]] = 2.0  # a three-way tie below token 5
    logits[:, 5] = 3.0
    logits[2, 9] = torch.nextafter(torch.tensor(2.0), torch.tensor(0.0))  # one ulp below: no tie
    counted = []
    real = sampler_module._count_at_least
    monkeypatch.setattr(sampler_module, "_count_at_least", lambda x, t: counted.append(x.shape[0]) or real(x, t))
    params = [SamplingParams(temperature=0.0, allowed_token_ids=[7], logprobs=2),
              SamplingParams(temperature=0.0),  # asks for no logprobs
              SamplingParams(temperature=0.0, allowed_token_ids=[7], logprobs=0)]
    out = Sampler(torch.Generator().manual_seed(0)).sample(logits, _rows(params))
    assert out.token_ids == [7, 5, 7] and counted == [2] and out.position_logprobs[1] is None
    assert out.position_logprobs[0].rank == 4 and out.position_logprobs[2].rank == 3
    ids = out.position_logprobs[0].token_ids
    assert ids[0] == 7 and ids[1] == 5 and ids[2] in (3, 7, 9)
    d = logprob_dict(out.position_logprobs[0])
    assert d[5].rank == 1 and d[ids[2]].rank == 2 and d[7].rank == (2 if ids[2] == 7 else 4)


def test_seeded_rows_do_not_depend_on_the_batch():
    torch.manual_seed(0)
    row = torch.randn(V)
    p_seeded = SamplingParams(temperature=1.0, seed=7)
    p_free = SamplingParams(temperature=1.0)

    def draw(batch_before: int, batch_after: int, steps: int = 20):
        gen = torch.Generator().manual_seed(7)
        sampler = Sampler(torch.Generator().manual_seed(123 + batch_before))
        toks = []
        for _ in range(steps):
            logits = torch.cat([torch.randn(batch_before, V), row[None], torch.randn(batch_after, V)])
            rows = [SampleRow(i, p_free, [1], []) for i in range(batch_before)]
            rows.append(SampleRow(batch_before, p_seeded, [1], [], gen))
            rows += [SampleRow(batch_before + 1 + i, p_free, [1], []) for i in range(batch_after)]
            toks.append(sampler.sample(logits, rows).token_ids[batch_before])
        return toks

    a, b, c = draw(0, 0), draw(3, 1), draw(7, 5)
    assert a == b == c
    assert len(set(a)) > 1  # really sampling
    gen8 = torch.Generator().manual_seed(8)
    other = [Sampler(torch.Generator()).sample(row[None], [SampleRow(0, p_seeded, [1], [], gen8)]).token_ids[0]
             for _ in range(20)]
    assert other != a


def test_derived_seeds_are_distinct_and_stable():
    seeds = [derive_seed(42, i) for i in range(100)]
    assert seeds[0] == 42
    assert len(set(seeds)) == 100
    assert seeds == [derive_seed(42, i) for i in range(100)]
    assert all(0 <= s < 2**63 for s in seeds)


def test_penalties_match_reference():
    torch.manual_seed(0)
    logits = torch.randn(3, V) * 2
    prompt, output = [1, 4, 4, 9], [9, 9, 17, 4, 30]
    params = [SamplingParams(repetition_penalty=1.3), SamplingParams(frequency_penalty=0.7),
              SamplingParams(presence_penalty=-0.5, frequency_penalty=0.2)]
    rows = [SampleRow(i, p, prompt, output) for i, p in enumerate(params)]
    got = apply_penalties(logits.clone(), rows)

    from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor
    hf = RepetitionPenaltyLogitsProcessor(1.3)(torch.tensor([prompt + output]), logits[0:1].clone())
    assert torch.allclose(got[0], hf[0])
    counts = np.bincount(output, minlength=V)
    ref1 = logits[1].numpy() - 0.7 * counts
    ref2 = logits[2].numpy() - 0.2 * counts + 0.5 * (counts > 0)
    assert np.allclose(got[1].numpy(), ref1, atol=1e-6)
    assert np.allclose(got[2].numpy(), ref2, atol=1e-6)
    # Rows without penalties in the same batch are untouched.
    mixed = apply_penalties(logits[:2].clone(), [rows[0], SampleRow(1, SamplingParams(), prompt, output)])
    assert torch.equal(mixed[1], logits[1])


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA"))])
def test_a_pending_token_counts_as_the_outputs_last(device):
    """pending (an overlapped step's token still on the device) penalises exactly as if it had
    been appended to the output; rows whose pending is vocab (none) are as without it. On CUDA
    nothing in it reads the device (sync debug mode raises on any sync)."""
    torch.manual_seed(0)
    logits = (torch.randn(3, V) * 2).to(device)
    prompt, output = [1, 4, 4, 9], [9, 9, 17, 4, 30]
    params = [SamplingParams(repetition_penalty=1.3), SamplingParams(frequency_penalty=0.7, presence_penalty=0.4),
              SamplingParams(frequency_penalty=0.5)]
    pending_ids = [23, 9, None]
    want = apply_penalties(logits.clone(), [SampleRow(i, p, prompt, output + ([t] if t is not None else []))
                                            for i, (p, t) in enumerate(zip(params, pending_ids))])
    pending = torch.tensor([V if t is None else t for t in pending_ids], device=device)
    rows = [SampleRow(i, p, prompt, output) for i, p in enumerate(params)]
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
    try:
        got = apply_penalties(logits.clone(), rows, pending)
    finally:
        if device == "cuda":
            torch.cuda.set_sync_debug_mode(0)
    assert torch.allclose(got, want, atol=1e-6)
    assert not torch.allclose(got[:2], apply_penalties(logits.clone(), rows)[:2])  # the pending ids mattered


def test_suppressed_tokens_are_never_sampled():
    logits = torch.zeros(2000, V)
    logits[:, 3] = 10.0  # would win almost always
    rows = [SampleRow(i, SamplingParams(temperature=1.0), [1], [], None, [3, 5]) for i in range(2000)]
    out = Sampler(torch.Generator().manual_seed(0)).sample(logits, rows)
    assert not {3, 5} & set(out.token_ids)
    greedy = Sampler(torch.Generator()).sample(logits[:1], [SampleRow(0, SamplingParams(temperature=0), [1], [], None, [3])])
    assert greedy.token_ids[0] != 3


def test_rows_may_share_a_logits_row():
    torch.manual_seed(0)
    logits = torch.randn(2, V)
    p = SamplingParams(temperature=1.0, seed=3)
    rows = [SampleRow(1, p, [1], [], torch.Generator().manual_seed(derive_seed(3, j))) for j in range(4)]
    got = Sampler(torch.Generator()).sample(logits, rows).token_ids
    for j in range(4):
        alone = Sampler(torch.Generator()).sample(
            logits[1:2], [SampleRow(0, p, [1], [], torch.Generator().manual_seed(derive_seed(3, j)))])
        assert alone.token_ids[0] == got[j]
