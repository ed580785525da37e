"""The fused plain-path sampling kernels on CUDA (skipped without a GPU) at Llama-3's vocabulary in
bfloat16, against torch on the same device: greedy tokens exactly torch.argmax's, logprobs within
1e-4, temperature draws following softmax(x / T) by a chi-square bound a correct sampler exceeds
with probability < 1e-6 (fixed seed), and draws that do not depend on how the vocabulary is split.
The interpreter runs the same cases on small shapes in CI (sampling_interpret_cases.py).
"""
import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

VOCAB = 128256


@pytest.fixture(scope="module")
def ts():
    from pagedserve.layers import triton_sampling
    return triton_sampling


@pytest.mark.parametrize("n", [1, 16, 256])
def test_greedy_equals_torch_argmax_at_llama_vocab(ts, n):
    g = torch.Generator(device="cuda").manual_seed(n)
    x = (torch.randn(n, VOCAB, device="cuda", generator=g) * 4).to(torch.bfloat16)
    x[0, 100] = x[0, VOCAB - 5] = x[0].float().max() + 1  # a tie: the lowest index
    tokens, packed = ts.sample_rows(x, None, seed=0)
    expected = x.float().argmax(dim=-1)
    assert torch.equal(tokens, expected)
    lp = torch.log_softmax(x.float(), dim=-1).gather(1, expected[:, None]).squeeze(1)
    torch.testing.assert_close(packed[:, 1].float(), lp, rtol=0, atol=1e-4)


def test_temperature_draws_follow_softmax(ts):
    logits = torch.full((VOCAB,), float("-inf"), device="cuda")
    logits[[3, 70000, VOCAB - 1]] = torch.tensor([0.0, 1.0, 2.0], device="cuda")
    temps = (0.6, 1.0)
    rows = 16000  # rows * vocab < 2**31: Philox offsets stay int32
    x = logits.repeat(rows, 1).to(torch.bfloat16)
    tokens, _ = ts.sample_rows(x, torch.tensor(temps, device="cuda").repeat(rows // 2), seed=123)
    for i, t in enumerate(temps):
        counts = torch.bincount(tokens[i::2], minlength=VOCAB).float()
        keep = torch.isfinite(logits)
        assert counts[~keep].sum() == 0
        probs = torch.softmax(logits.float() / t, dim=-1)[keep]
        expected = probs * counts[keep].sum()
        chi2 = float(((counts[keep] - expected) ** 2 / expected).sum())
        assert chi2 < 30.66, (t, counts[keep], expected)  # df = 2, checked at the df = 3 bound


def test_draws_do_not_depend_on_splits(ts):
    x = torch.randn(16, VOCAB, device="cuda").to(torch.bfloat16)
    temps = torch.full((16,), 0.7, device="cuda")
    draws = [ts.sample_rows(x, temps, seed=9, splits=s)[0] for s in (1, 7, ts.MAX_SPLITS)]
    assert all(torch.equal(draws[0], d) for d in draws[1:])
