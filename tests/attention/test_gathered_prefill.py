"""gathered_prefill.py (PAGEDSERVE_LONG_PREFILL=cudnn): a long chunk's attention over its gathered,
padded context equals reference.py's over the pages. On CPU the cuDNN and flash ops are stood in
for by plain softmax attention with the same signatures (bias, scale, log-sum-exp); the CUDA ops
themselves are checked in tests/attention/test_triton_gpu.py and timed by prefill_sweep.py."""
import pytest
import torch

from pagedserve.attention import gathered_prefill as gp, reference
from paged_batch import make_batch


def math_prefix(q, k, v, bias, scale):
    scores = (q.float() @ k.float().transpose(-1, -2)) * scale + bias.float()
    return (scores.softmax(-1) @ v.float()).to(q.dtype), scores.logsumexp(-1)


def math_square(q, k, v, scale):
    scores = (q.float() @ k.float().transpose(-1, -2)) * scale
    scores = scores.masked_fill(torch.ones_like(scores, dtype=torch.bool).triu(1), float("-inf"))
    return (scores.softmax(-1) @ v.float()).to(q.dtype), scores.logsumexp(-1)


@pytest.fixture
def small_buckets(monkeypatch):
    monkeypatch.setattr(gp, "PREFIX_BUCKET", 32)
    monkeypatch.setattr(gp, "QUERY_BUCKET", 8)
    monkeypatch.setattr(gp, "MIN_PREFIX", 40)
    monkeypatch.setattr(gp, "MIN_CHUNK", 4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("cached,new,block_size", [(40, 4, 16), (77, 13, 8), (96, 32, 16), (100, 9, 1)])
def test_long_chunk_equals_reference(small_buckets, dtype, cached, new, block_size):
    """Prefixes off and on the bucket edge (96 = 3 x 32: no pad), chunks off and on the query
    bucket, pages of 1/8/16 tokens; the pool's spare slots are random (garbage past the sequence)."""
    batch = make_batch([(3, 1), (cached, new)], 1, H=6, Hkv=2, D=16, block_size=block_size, dtype=dtype)
    kc, vc = batch.k_cache.clone(), batch.v_cache.clone()
    reference.write_kv(batch.new_k, batch.new_v, kc, vc, batch.meta.slot_mapping)
    scale = 16 ** -0.5
    ref = reference.paged_attention(batch.query, kc, vc, batch.meta, scale)[1:]
    g = gp.GatheredPrefill(160, 2, 16, dtype, torch.device("cpu"), math_prefix, math_square)
    g.k.fill_(float("nan"))  # a stale NaN in the buffer's pad must not reach the output
    got = g.attend(batch.query[1:], kc, vc, batch.meta.block_tables[1], cached + new, scale)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(got, ref, **tol)


def test_which_chunks_take_the_path(small_buckets):
    batch = make_batch([(3, 1), (50, 2), (39, 8), (40, 4), (0, 60), (45, 5)], 1, H=2, Hkv=1, D=8, block_size=8)
    assert gp.long_chunks(batch.meta, batch.k_cache) == [3, 5]  # >= 4 new tokens after >= 40
    assert gp.long_chunks(batch.meta, batch.k_cache.to(torch.float8_e4m3fn)) == []
    assert gp.other_ranges(1, 6, [3, 5]) == [(1, 2), (4, 1)]
    assert gp.other_ranges(1, 6, []) == [(1, 5)]


def test_plan_shapes_cover_every_chunk(small_buckets):
    """Every (chunk, context) the path takes lands on a shape warm_up_plans builds."""
    g = gp.GatheredPrefill(200, 1, 8, torch.float32, torch.device("cpu"))
    shapes = set(g.shapes(max_tokens=24))
    for seq_len in range(1, 201):
        for new in range(1, min(24, seq_len) + 1):
            if gp.takes(new, seq_len):
                assert (gp.bucket(new, gp.QUERY_BUCKET), gp.bucket(seq_len - new, gp.PREFIX_BUCKET)) in shapes


def test_switch_values(monkeypatch):
    monkeypatch.delenv(gp.LONG_PREFILL_ENV, raising=False)
    assert not gp.enabled()
    monkeypatch.setenv(gp.LONG_PREFILL_ENV, "cudnn")
    assert gp.enabled()
    monkeypatch.setenv(gp.LONG_PREFILL_ENV, "flash")
    with pytest.raises(ValueError, match=gp.LONG_PREFILL_ENV):
        gp.enabled()
