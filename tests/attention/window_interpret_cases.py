"""Sliding-window attention and soft-capped scores (Gemma 2) in the Triton kernels (decode in every
split mode, prefill plain and GQA-packed, the unified kernel) under the Triton interpreter (CPU),
against reference.py's, which tests/test_reference_attention.py checks against dense SDPA with
HF's mask and HF's soft-capped eager attention. Run by
test_window_interpret.py in a subprocess with TRITON_INTERPRET=1 (see triton_interpret_cases.py)."""
import os
from dataclasses import replace

import pytest
import torch

from pagedserve.attention import reference
from paged_batch import make_batch

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("run through test_window_interpret.py (needs TRITON_INTERPRET=1 before importing triton)",
                allow_module_level=True)

from interpreter_fixes import apply as _fix_interpreter  # noqa: E402

_fix_interpreter()

from pagedserve.attention import decode_plan, gathered_prefill, triton_ops as ops  # noqa: E402
from pagedserve.attention.triton_prefill import parse_prefill_launch, prefill_attention  # noqa: E402

TOL32 = dict(rtol=1e-4, atol=1e-4)
# Decodes (one shorter than any window), a fresh prompt longer than the windows, an extend whose
# chunk crosses block boundaries after a cached prefix, a decode far past the window.
MIXED = [(70, 1), (2, 1), (37, 1), (0, 45), (29, 19), (5, 3)]


def _written(batch, window, softcap=0.0):
    """The pools with this step's K/V written, the reference output over them, and the same
    without window or cap."""
    kc, vc = batch.k_cache.clone(), batch.v_cache.clone()
    reference.write_kv(batch.new_k, batch.new_v, kc, vc, batch.meta.slot_mapping)
    ref = reference.paged_attention(batch.query, kc, vc, batch.meta, batch.query.shape[-1] ** -0.5, window=window,
                                    softcap=softcap)
    full = reference.paged_attention(batch.query, kc, vc, batch.meta, batch.query.shape[-1] ** -0.5)
    return kc, vc, ref, full


@pytest.mark.parametrize("window", [1, 5, 16, 40])
@pytest.mark.parametrize("block_size,H,Hkv,D", [(1, 4, 4, 8), (8, 8, 2, 16), (16, 6, 1, 32)])
def test_mixed_batch_matches_reference(window, block_size, H, Hkv, D):
    """paged_attention's split path (decode kernel + prefill kernel) with a window."""
    batch = make_batch(MIXED, 3, H=H, Hkv=Hkv, D=D, block_size=block_size, seed=window + block_size)
    kc, vc, ref, full = _written(batch, window)
    assert not torch.allclose(ref, full, **TOL32)  # the window changes the answer: the test can fail
    out = ops.paged_attention(batch.query, kc, vc, batch.meta, D ** -0.5, window=window)
    torch.testing.assert_close(out, ref, **TOL32)


@pytest.mark.parametrize("split_tokens,num_splits", [(0, 1), (0, 3), (16, 1), (decode_plan.BALANCED, 1),
                                                     (decode_plan.SLOTS, 1)])
@pytest.mark.parametrize("longest_first", [False, True])
def test_decode_split_modes_plan_over_the_window(split_tokens, num_splits, longest_first):
    """Every decode plan cuts the rows' windows (lengths clamped to 50), shifted to their last
    positions; rows shorter than the window read all of theirs. A plan over the full lengths
    would read positions before the window, or give the 300-token row splits the reduce never
    finds."""
    shapes = [(299, 1), (0, 1), (12, 1), (49, 1), (50, 1), (130, 1)]
    batch = make_batch(shapes, 6, H=8, Hkv=2, D=16, block_size=8, seed=num_splits)
    kc, vc, ref, _ = _written(batch, 50)
    m = batch.meta
    out = torch.full_like(batch.query, float("nan"))
    order = ops.longest_first(m.seq_lens) if longest_first else None
    ops.paged_decode(batch.query, kc, vc, m.seq_lens, m.block_tables, 4096, 16 ** -0.5, out, num_splits=num_splits,
                     block_n=16, split_tokens=split_tokens, share_programs=4, min_chain_tiles=1, order=order,
                     window=50)
    torch.testing.assert_close(out, ref, **TOL32)


@pytest.mark.parametrize("lpt", [False, True])
@pytest.mark.parametrize("gqa,block_m", [(False, 16), (True, 32)])
def test_prefill_tiles_start_at_the_window(gqa, block_m, lpt):
    """Chunks of 2-3 tiles after cached prefixes: a tile's rows see different first positions (the
    first tiles it reads are partly hidden from some rows, wholly from others)."""
    shapes = [(40, 37), (0, 50), (17, 9)]
    batch = make_batch(shapes, 0, H=8, Hkv=2, D=16, block_size=8, seed=7)
    kc, vc, ref, _ = _written(batch, 12)
    m = batch.meta
    out = torch.full_like(batch.query, float("nan"))
    ops.paged_prefill(batch.query, kc, vc, m.query_start_loc, m.seq_lens, m.block_tables, 0, 3, m.max_query_len,
                      16 ** -0.5, out, block_m=block_m, block_n=16, num_warps=4, num_stages=1, gqa=gqa, lpt=lpt,
                      window=12)
    torch.testing.assert_close(out, ref, **TOL32)


def test_prefill_refuses_tma_with_a_window():
    batch = make_batch([(0, 4)], 0, H=2, Hkv=2, D=16, block_size=16, seed=1)
    m = batch.meta
    with pytest.raises(ValueError, match="sliding-window"):
        prefill_attention(batch.query, batch.k_cache, batch.v_cache, m.query_start_loc, m.seq_lens, m.block_tables,
                          0, 1, 4, 0.25, torch.empty_like(batch.query), parse_prefill_launch("bn16+tma"), True, {},
                          window=3)


@pytest.mark.parametrize("window", [1, 12, 40])
@pytest.mark.parametrize("share", [3, 1000])
def test_unified_kernel_matches_reference(window, share):
    """The unified kernel (a full graph's path): items start at each q tile's window, split over
    few programs (share 3: many splits, some of whose rows see nothing) or none."""
    batch = make_batch(MIXED, 3, H=8, Hkv=2, D=16, block_size=8, seed=window + share)
    kc, vc, ref, _ = _written(batch, window)
    meta = replace(batch.meta, unified_work=None)
    out = ops.unified_paged_attention(batch.query, kc, vc, meta, 16 ** -0.5, block_m=16, block_n=16,
                                      share_programs=share, min_chain_tiles=1, window=window)
    torch.testing.assert_close(out, ref, **TOL32)


def test_unified_work_lists_per_window_share_one_step():
    """Layers of two windows (and none) in one step: each gets its own work list, built once and
    reused by the next layer of the same window, with the split buffers shared."""
    batch = make_batch(MIXED, 3, H=8, Hkv=2, D=16, block_size=8, seed=3)
    kc, vc, _, full = _written(batch, 0)
    meta = replace(batch.meta, unified_work=None, unified_capacity=ops.unified_capacity(
        batch.query.shape[0], batch.meta.num_seqs, 8, 2, torch.device("cpu"), block_m=16))
    for window in (0, 7, 0, 20, 7):
        out = ops.unified_paged_attention(batch.query, kc, vc, meta, 16 ** -0.5, block_m=16, window=window)
        ref = reference.paged_attention(batch.query, kc, vc, batch.meta, 16 ** -0.5, window=window)
        torch.testing.assert_close(out, ref, **TOL32)
    assert sorted(meta.unified_work) == [0, 7, 20]
    assert len({id(mid) for _, mid in meta.unified_work.values()}) == 1


def test_windowed_layers_skip_the_gathered_long_prefill(monkeypatch):
    """cuDNN's dense attention has no window: a windowed layer keeps its long chunks on the kernel."""
    class Gathered:
        def chunks(self, meta, query, k_cache):
            raise AssertionError("a windowed layer reached the gathered path")
    monkeypatch.setattr(gathered_prefill, "active", lambda device: Gathered())
    batch = make_batch([(3, 1), (30, 40)], 1, H=4, Hkv=2, D=16, block_size=8, seed=2)
    kc, vc, ref, _ = _written(batch, 9)
    out = ops.paged_attention(batch.query, kc, vc, batch.meta, 0.25, window=9)
    torch.testing.assert_close(out, ref, **TOL32)


# Soft caps small enough to change the answer at these scores (|q.k| * scale ~ 1-3).
@pytest.mark.parametrize("window,softcap", [(0, 1.5), (16, 1.5), (0, 50.0)])
def test_softcap_mixed_batch_matches_reference(window, softcap):
    batch = make_batch(MIXED, 3, H=8, Hkv=2, D=16, block_size=8, seed=11)
    kc, vc, ref, full = _written(batch, window, softcap)
    if softcap < 10:
        assert not torch.allclose(ref, full, **TOL32)
    out = ops.paged_attention(batch.query, kc, vc, batch.meta, 16 ** -0.5, window=window, softcap=softcap)
    torch.testing.assert_close(out, ref, **TOL32)


@pytest.mark.parametrize("split_tokens", [decode_plan.BALANCED, decode_plan.SLOTS])
def test_softcap_decode_splits_match_reference(split_tokens):
    shapes = [(299, 1), (0, 1), (12, 1), (130, 1)]
    batch = make_batch(shapes, 4, H=8, Hkv=2, D=16, block_size=8, seed=4)
    kc, vc, ref, _ = _written(batch, 0, 1.5)
    m = batch.meta
    out = torch.full_like(batch.query, float("nan"))
    ops.paged_decode(batch.query, kc, vc, m.seq_lens, m.block_tables, 4096, 16 ** -0.5, out, num_splits=1,
                     block_n=16, split_tokens=split_tokens, share_programs=4, min_chain_tiles=1, softcap=1.5)
    torch.testing.assert_close(out, ref, **TOL32)


@pytest.mark.parametrize("gqa", [False, True])
def test_softcap_prefill_matches_reference(gqa):
    batch = make_batch([(40, 37), (0, 50)], 0, H=8, Hkv=2, D=16, block_size=8, seed=9)
    kc, vc, ref, _ = _written(batch, 0, 1.5)
    m = batch.meta
    out = torch.full_like(batch.query, float("nan"))
    ops.paged_prefill(batch.query, kc, vc, m.query_start_loc, m.seq_lens, m.block_tables, 0, 2, m.max_query_len,
                      16 ** -0.5, out, block_m=32, block_n=16, num_warps=4, num_stages=1, gqa=gqa, softcap=1.5)
    torch.testing.assert_close(out, ref, **TOL32)


@pytest.mark.parametrize("window", [0, 12])
def test_softcap_unified_kernel_matches_reference(window):
    batch = make_batch(MIXED, 3, H=8, Hkv=2, D=16, block_size=8, seed=5)
    kc, vc, ref, _ = _written(batch, window, 1.5)
    meta = replace(batch.meta, unified_work=None)
    out = ops.unified_paged_attention(batch.query, kc, vc, meta, 16 ** -0.5, block_m=16, block_n=16,
                                      share_programs=3, min_chain_tiles=1, window=window, softcap=1.5)
    torch.testing.assert_close(out, ref, **TOL32)


def test_window_lengths_are_clamped_once_per_step():
    """Every layer of a window reuses the step's clamped decode lengths (as decode_order)."""
    batch = make_batch(MIXED, 3, H=4, Hkv=2, D=16, block_size=8, seed=6)
    kc, vc, ref, _ = _written(batch, 5)
    meta = replace(batch.meta, window_lens={})
    first = ops.paged_attention(batch.query, kc, vc, meta, 0.25, window=5)
    lens = meta.window_lens[5]
    again = ops.paged_attention(batch.query, kc, vc, meta, 0.25, window=5)
    assert meta.window_lens[5] is lens and lens.tolist() == [5, 3, 5]
    torch.testing.assert_close(first, ref, **TOL32)
    torch.testing.assert_close(again, first, rtol=0, atol=0)
