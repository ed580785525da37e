"""Cases for the unified varlen kernel (triton_unified.py) under the Triton interpreter (CPU),
checked against reference.py; run by test_unified_interpret.py in a subprocess with
TRITON_INTERPRET=1 (see triton_interpret_cases.py for why). Tiny heads, so the 2k-token chunk
stays quick."""
import os
from dataclasses import replace

import pytest
import torch

from pagedserve.attention import reference
from paged_batch import make_batch

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("run through test_unified_interpret.py (needs TRITON_INTERPRET=1 before importing triton)",
                allow_module_level=True)

from interpreter_fixes import apply as _fix_interpreter  # noqa: E402

_fix_interpreter()

from pagedserve.attention import triton_ops as ops  # noqa: E402
from pagedserve.attention.kv_quant import quantize_kv  # noqa: E402

TOL32 = dict(rtol=1e-4, atol=1e-4)


def _written(batch, k_scale=None, v_scale=None):
    """The pools with this step's K/V written, and the reference output over them."""
    kc, vc = batch.k_cache.clone(), batch.v_cache.clone()
    reference.write_kv(batch.new_k, batch.new_v, kc, vc, batch.meta.slot_mapping, k_scale, v_scale)
    ref = reference.paged_attention(batch.query, kc, vc, batch.meta, scale=batch.query.shape[-1] ** -0.5,
                                    k_scale=k_scale, v_scale=v_scale)
    return kc, vc, ref


def _unified(batch, kc, vc, **kw):
    meta = replace(batch.meta, unified_work=None)
    return ops.unified_paged_attention(batch.query, kc, vc, meta, batch.query.shape[-1] ** -0.5, **kw), meta


@pytest.mark.parametrize("block_size,H,Hkv,D", [(1, 4, 4, 8), (8, 8, 2, 16), (16, 6, 1, 32), (8, 6, 1, 32)])
def test_mixed_batch_matches_reference(block_size, H, Hkv, D):
    """Decodes (one over a 1-token context) beside a fresh chunk and prefix-cached extends whose
    tokens cross block boundaries; MHA and GQA (a group of 6 padded to 8)."""
    shapes = [(20, 1), (0, 1), (37, 1), (0, 19), (13, 6), (40, 1), (7, 30)]
    batch = make_batch(shapes, 3, H=H, Hkv=Hkv, D=D, block_size=block_size, seed=block_size + H)
    kc, vc, ref = _written(batch)
    out, _ = _unified(batch, kc, vc, block_m=16, block_n=16)
    torch.testing.assert_close(out, ref, **TOL32)


@pytest.mark.parametrize("share,min_chain", [(1, 1), (12, 1), (40, 2), (1000, 1)])
def test_kv_splits_and_empty_rows_match_reference(share, min_chain):
    """The split plan shares the step's tiles over `share` programs: 1, no split at all; 1000,
    chains of min_chain tiles, so long tiles get many KV splits. Later splits of a chunk's tile
    start after some of its rows' positions (rows that see nothing there, lse -inf); decodes of
    1-2 tokens keep one split."""
    shapes = [(129, 1), (0, 1), (2, 1), (100, 1), (45, 40), (0, 70)]
    batch = make_batch(shapes, 4, H=4, Hkv=2, D=16, block_size=8, seed=share)
    kc, vc, ref = _written(batch)
    out, meta = _unified(batch, kc, vc, block_m=32, block_n=16, share_programs=share, min_chain_tiles=min_chain)
    torch.testing.assert_close(out, ref, **TOL32)
    work, _ = meta.unified_work[0]  # the list of layers without a sliding window
    splits = work.qtiles[:, 3]
    assert (int(splits.max()) > 1) == (share > 1)


def test_decode_rows_beside_a_2k_chunk():
    """A 2k-token chunk over earlier context beside decodes: one launch, the chunk's tiles split
    by the balanced plan, so the decodes' few tiles do not wait on it."""
    shapes = [(300, 1), (5, 1), (17, 1), (64, 2048)]
    batch = make_batch(shapes, 3, H=2, Hkv=1, D=16, block_size=16, seed=5)
    kc, vc, ref = _written(batch)
    out, _ = _unified(batch, kc, vc, block_m=128, block_n=128, share_programs=64)
    torch.testing.assert_close(out, ref, **TOL32)


def test_bucket_padding_is_not_written():
    """A graph bucket: more token rows than the step has and sequences with no tokens (q_len 0,
    the padding of the static buffers) at the end; real rows match, padding rows stay as they were."""
    batch = make_batch([(9, 1), (0, 12), (30, 5)], 1, H=4, Hkv=2, D=16, block_size=8, seed=2)
    kc, vc, ref = _written(batch)
    m = batch.meta
    n = batch.query.shape[0]
    pad_rows, pad_seqs = 11, 4
    query = torch.cat([batch.query, torch.randn(pad_rows, 4, 16)])
    qsl = torch.cat([m.query_start_loc, m.query_start_loc[-1:].repeat(pad_seqs)])
    seq_lens = torch.cat([m.seq_lens, torch.ones(pad_seqs, dtype=torch.int32)])
    tables = torch.cat([m.block_tables, torch.zeros(pad_seqs, m.block_tables.shape[1], dtype=torch.int32)])
    meta = replace(m, query_start_loc=qsl, seq_lens=seq_lens, block_tables=tables,
                   unified_capacity=ops.unified_capacity(n + pad_rows, m.num_seqs + pad_seqs, 4, 2,
                                                         torch.device("cpu"), block_m=16))
    out = torch.full_like(query, float("nan"))
    ops.unified_paged_attention(query, kc, vc, meta, 0.25, out=out, block_m=16, block_n=16, share_programs=8)
    torch.testing.assert_close(out[:n], ref, **TOL32)
    assert torch.isnan(out[n:]).all()


def test_paged_attention_takes_the_unified_path_when_asked():
    batch = make_batch([(20, 1), (3, 9)], 1, H=4, Hkv=2, D=16, block_size=8, seed=4)
    kc, vc, ref = _written(batch)
    meta = replace(batch.meta, unified_capacity=ops.unified_capacity(10, 2, 4, 2, torch.device("cpu")))
    out = ops.paged_attention(batch.query, kc, vc, meta, scale=0.25)
    assert meta.unified_work is not None
    torch.testing.assert_close(out, ref, **TOL32)


def test_half_precision_matches_reference():
    batch = make_batch([(25, 1), (0, 9), (11, 40)], 1, H=4, Hkv=2, D=16, block_size=8, dtype=torch.float16)
    kc, vc, ref = _written(batch)
    out, _ = _unified(batch, kc, vc, block_m=16, block_n=16, share_programs=2)
    torch.testing.assert_close(out.float(), ref.float(), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("qdtype", [torch.float32, torch.float16])
def test_fp8_kv_matches_reference(qdtype):
    """e4m3 pools with per-layer scales: dequantized in registers, as the reference reads them."""
    batch = make_batch([(33, 1), (0, 1), (18, 21)], 2, H=4, Hkv=2, D=16, block_size=8, seed=9)
    ks, vs = torch.tensor([0.02]), torch.tensor([0.015])
    batch.k_cache, batch.v_cache = quantize_kv(batch.k_cache, ks), quantize_kv(batch.v_cache, vs)
    batch.query = batch.query.to(qdtype)
    kc, vc, ref = _written(batch, ks, vs)
    out, _ = _unified(batch, kc, vc, k_scale=ks, v_scale=vs, block_m=16, block_n=16, share_programs=3)
    tol = TOL32 if qdtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(out.float(), ref.float(), **tol)


def test_fp8_per_head_scales_match_reference():
    """[num_kv_heads] scales 40x apart: each program reads its own KV head's (GQA group 2, 3 KV heads)."""
    batch = make_batch([(33, 1), (0, 1), (18, 21)], 2, H=6, Hkv=3, D=16, block_size=8, seed=13)
    ks, vs = torch.tensor([0.002, 0.08, 0.03]), torch.tensor([0.05, 0.00125, 0.01])
    batch.k_cache, batch.v_cache = quantize_kv(batch.k_cache, ks), quantize_kv(batch.v_cache, vs)
    kc, vc, ref = _written(batch, ks, vs)
    want = reference.paged_attention(batch.query, kc.float() * ks[:, None], vc.float() * vs[:, None], batch.meta,
                                     scale=batch.query.shape[-1] ** -0.5)
    torch.testing.assert_close(ref, want, rtol=1e-5, atol=1e-6)
    out, _ = _unified(batch, kc, vc, k_scale=ks, v_scale=vs, block_m=16, block_n=16, share_programs=3)
    torch.testing.assert_close(out, ref, **TOL32)
