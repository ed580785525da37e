"""Cases for the fused plain-path sampling kernels (pagedserve/layers/triton_sampling.py) under
the Triton interpreter on CPU, against torch.

Not collected on its own: test_fused_interpret.py runs this file in a subprocess with
TRITON_INTERPRET=1 (Triton picks interpreter-or-compiler at import time).

What is exact and what is not:
- greedy tokens: exactly torch.argmax of the logits (ties to the lowest index), in every dtype
  and for every way of cutting the vocabulary into spans;
- the chosen token's logprob: log_softmax's within 1e-5 (an online logsumexp, summed in another order);
- temperature draws: a distribution, so checked as one: frequencies over many rows against
  softmax(x / T) by a chi-square bound that a correct sampler fails with probability < 1e-6 and
  that any wrong temperature, a missing noise term or a biased index fails at once. The seed is
  fixed, so the outcome is too.
"""
import os

import pytest
import torch

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("run through test_fused_interpret.py (needs TRITON_INTERPRET=1 before importing triton)",
                allow_module_level=True)

from interpreter_fixes import apply as _fix_interpreter  # noqa: E402

_fix_interpreter()

from pagedserve.layers import fused  # noqa: E402
from pagedserve.layers import triton_sampling as ts  # noqa: E402
from pagedserve.layers.sampler import Sampler  # noqa: E402

BLOCK = ts.BLOCK


def _ref_logprobs(x: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(x.float(), dim=-1).gather(1, tokens[:, None]).squeeze(1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n,vocab", [(1, 300), (3, BLOCK + 7), (5, 3 * BLOCK + 1), (2, 2 * BLOCK + 48)])
@pytest.mark.parametrize("splits", [1, 2, 3, None])
def test_greedy_is_torch_argmax(dtype, n, vocab, splits):
    """The last shape's vocabulary is a multiple of 16: the kernel reads it in units of 16."""
    g = torch.Generator().manual_seed(n * vocab)
    x = torch.randn(n, vocab, generator=g).to(dtype)
    top = x.float().max() + 1
    # Ties: the lowest index wins, inside one block, across blocks and across spans.
    x[0, 5] = x[0, vocab - 2] = top
    if n > 1:
        x[1, BLOCK - 1 if vocab > BLOCK else 7] = x[1, vocab - 1] = top
    tokens, packed = ts.sample_rows(x, None, seed=3, splits=splits)
    expected = x.float().argmax(dim=-1)
    assert torch.equal(tokens, expected)
    assert tokens.dtype == torch.int64 and packed.dtype == torch.float64 and packed.shape == (n, 2)
    assert torch.equal(packed[:, 0].long(), expected)
    torch.testing.assert_close(packed[:, 1].float(), _ref_logprobs(x, expected), rtol=0, atol=1e-5)


def test_greedy_ignores_minus_inf_and_reads_row_strides():
    x = torch.randn(4, 2 * BLOCK + 40)
    x[:, : BLOCK + 3] = float("-inf")  # a whole first span masked
    wide = torch.randn(4, x.shape[1] + 16)
    wide[:, : x.shape[1]] = x  # rows padded: stride(0) > vocab
    view = wide[:, : x.shape[1]]
    tokens, packed = ts.sample_rows(view, None, seed=0, splits=3)
    assert torch.equal(tokens, x.argmax(dim=-1))
    torch.testing.assert_close(packed[:, 1].float(), _ref_logprobs(x, tokens), rtol=0, atol=1e-5)


@pytest.mark.parametrize("pad", [16, 8])
def test_row_strides_in_units_of_16_or_not(pad):
    """Rows padded by 16 (stride and vocabulary multiples of 16: UNIT 16, the stride handed over in
    sixteens) or by 8 (UNIT 1): the same argmax, and a draw the same as from the unpadded logits
    (it depends on the logits and the seed, not on the layout or the unit)."""
    n, vocab = 3, 2 * BLOCK + 32
    g = torch.Generator().manual_seed(pad)
    x = torch.randn(n, vocab, generator=g).to(torch.bfloat16)
    wide = torch.randn(n, vocab + pad, generator=g).to(torch.bfloat16)
    wide[:, :vocab] = x
    view = wide[:, :vocab]
    assert (ts.logits_unit(x), ts.logits_unit(view)) == (16, 16 if pad == 16 else 1)
    tokens, packed = ts.sample_rows(view, None, seed=0, splits=2)
    assert torch.equal(tokens, x.float().argmax(dim=-1))
    torch.testing.assert_close(packed[:, 1].float(), _ref_logprobs(x, tokens), rtol=0, atol=1e-5)
    temps = torch.full((n,), 0.8)
    assert torch.equal(ts.sample_rows(view, temps, seed=4, splits=2)[0], ts.sample_rows(x, temps, seed=4, splits=3)[0])


def _chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


# The chi-square value a correct sampler exceeds with probability < 1e-6, by degrees of freedom
# (scipy.stats.chi2.isf(1e-6, df)).
CHI2_1E6 = {2: 27.63, 3: 30.66}


def test_temperature_draws_follow_softmax():
    """Rows at two temperatures, alternating, in one launch (the interpreter runs programs one by
    one, ~18 ms a row on a 2-core machine: 1,200 rows is the budget): each half's frequencies
    follow its softmax(x / T); the masked token is never drawn; the reported logprob is the raw
    one, whatever T.

    One sharper and one flatter than the logits: a kernel that ignored T, used T for 1/T, or read
    another row's temperature fails both (the chi-square of T=2's rows drawn at T=1 is ~100 at
    600 rows, against a bound of 30.66). T=1 (a third of the rows once) fails none of those alone."""
    logits = torch.tensor([0.0, 1.0, 2.0, float("-inf"), -1.0])
    temps = (0.5, 2.0)
    rows = 600 * len(temps)
    x = logits.repeat(rows, 1).to(torch.bfloat16)
    tokens, packed = ts.sample_rows(x, torch.tensor(temps).repeat(rows // len(temps)), seed=11)
    for i, t in enumerate(temps):
        counts = torch.bincount(tokens[i::len(temps)], minlength=5).float()
        assert counts[3] == 0
        keep = torch.tensor([True, True, True, False, True])
        probs = torch.softmax(x[0].float() / t, dim=-1)[keep]
        assert _chi_square(counts[keep], probs) < CHI2_1E6[3], (t, counts, probs)
    torch.testing.assert_close(packed[:, 1].float(), _ref_logprobs(x, tokens), rtol=0, atol=1e-5)


@pytest.mark.parametrize("splits", [1, 3])
def test_draws_follow_softmax_across_blocks_and_spans(splits):
    """Three live tokens, one in each BLOCK of a row, larger logits later: in one span (splits=1)
    the race so far is rescaled twice as the largest logit grows; in three, each span reports its
    winner's Gumbel score and the merge compares them. Either way the frequencies follow
    softmax(x / T). A race not rescaled, or a score without its m / T, draws token 0 far too often."""
    vocab, t, rows = 2 * BLOCK + 3, 0.5, 300
    live = [5, BLOCK + 7, 2 * BLOCK + 1]
    x = torch.full((vocab,), float("-inf"))
    x[live] = torch.tensor([0.0, 0.5, 1.0])
    tokens, _ = ts.sample_rows(x.repeat(rows, 1), torch.full((rows,), t), seed=5, splits=splits)
    counts = torch.stack([(tokens == i).sum() for i in live]).float()
    assert counts.sum() == rows  # never a masked token
    probs = torch.softmax(x[live] / t, dim=-1)
    assert _chi_square(counts, probs) < CHI2_1E6[2], (counts, probs)


def test_draws_depend_on_seed_and_row_not_on_spans():
    x = torch.randn(8, 3 * BLOCK + 5)
    temps = torch.ones(8)
    a, _ = ts.sample_rows(x, temps, seed=7, splits=1)
    b, _ = ts.sample_rows(x, temps, seed=7, splits=4)
    c, _ = ts.sample_rows(x, temps, seed=8, splits=4)
    assert torch.equal(a, b)
    assert not torch.equal(a, c)
    # nor on the launch a sweep tries (benchmarks/kernels/sampling_sweep.py): tokens a loop reads, warps
    for block, warps, splits in ((256, 4, 3), (4096, 16, 2), (64, 2, 1)):
        d, packed = ts.sample_rows(x, temps, seed=7, splits=splits, block=block, num_warps=warps)
        assert torch.equal(a, d), (block, warps, splits)
        g, _ = ts.sample_rows(x, None, seed=0, splits=splits, block=block, num_warps=warps)
        assert torch.equal(g, x.argmax(dim=-1))
    with pytest.raises(ValueError, match="block must be a power of two"):
        ts.sample_rows(x, temps, seed=7, block=100)


def test_rejects_what_it_cannot_take():
    x = torch.randn(4, 10)
    with pytest.raises(ValueError, match="seed"):
        ts.sample_rows(x, None, seed=1 << 31)
    with pytest.raises(ValueError, match="splits"):
        ts.sample_rows(x, None, seed=0, splits=ts.MAX_SPLITS + 1)
    assert not ts.supports(x.t())  # vocab not unit-stride
    assert not ts.supports(torch.randn(10))


@pytest.fixture
def forced(monkeypatch):
    monkeypatch.setenv("PAGEDSERVE_FUSED_SAMPLING", "force")
    fused.reset()
    yield
    monkeypatch.delenv("PAGEDSERVE_FUSED_SAMPLING")
    fused.reset()


def test_sampler_plain_path_uses_the_kernels(forced):
    assert fused.fused_sampling(torch.device("cpu")) is ts
    x = torch.randn(6, 1000).to(torch.bfloat16)
    sampler = Sampler(torch.Generator().manual_seed(0))
    greedy = sampler.sample_plain_device(x, [0.0] * 6)
    assert greedy.packed_ready is not None
    assert torch.equal(greedy.tokens, x.float().argmax(dim=-1))
    out = greedy.to_host()
    assert out.token_ids == x.float().argmax(dim=-1).tolist()
    assert out.position_logprobs == [None] * 6
    assert max(abs(a - b) for a, b in zip(out.logprobs, _ref_logprobs(x, greedy.tokens).tolist())) < 1e-5
    # Temperature: a new seed each step, reproducible from the generator's seed.
    first = [sampler.sample_plain_device(x, [0.9] * 6).tokens for _ in range(3)]
    again = Sampler(torch.Generator().manual_seed(0))
    again.sample_plain_device(x, [0.0] * 6)
    assert all(torch.equal(a, again.sample_plain_device(x, [0.9] * 6).tokens) for a in first)
    assert not all(torch.equal(first[0], f) for f in first[1:])
    with pytest.raises(ValueError, match="all greedy or all temperature"):
        sampler.sample_plain_device(x, [0.0, 0.5, 0.5, 0.5, 0.5, 0.5])


def test_engine_greedy_tokens_equal_torch_sampling(tiny_model_dir, monkeypatch):
    """A whole engine (overlapped steps) with the fused kernels forced on gives the torch path's
    greedy tokens; a temperature run completes with tokens inside the vocabulary."""
    from pagedserve import LLM, SamplingParams
    from pagedserve.models.loader import load_hf_config

    prompts = [{"prompt_token_ids": p} for p in ([5, 17, 33, 101, 7], [9], list(range(3, 30)))]
    model = tiny_model_dir("llama")

    def run(params):
        llm = LLM(str(model), device="cpu", dtype="float32", num_gpu_blocks_override=256, swap_space=0.01)
        try:
            tokens = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
            return tokens, llm.llm_engine.sampler._fused_draws  # steps the kernels sampled
        finally:
            llm.shutdown()

    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    monkeypatch.setenv("PAGEDSERVE_FUSED_SAMPLING", "0")
    fused.reset()
    expected, draws = run(greedy)
    assert draws == 0
    monkeypatch.setenv("PAGEDSERVE_FUSED_SAMPLING", "force")
    fused.reset()
    try:
        actual, draws = run(greedy)
        assert actual == expected and draws >= 12
        sampled, draws = run(SamplingParams(temperature=0.8, max_tokens=12, ignore_eos=True))
        assert draws >= 12
    finally:
        monkeypatch.delenv("PAGEDSERVE_FUSED_SAMPLING")
        fused.reset()
    vocab = load_hf_config(model).vocab_size
    assert all(len(t) == 12 for t in sampled)
    assert all(0 <= tok < vocab for t in sampled for tok in t)
