"""Cases for the Triton kernels under the Triton interpreter (CPU), checked against reference.py.

Not collected on its own: test_triton_interpret.py runs this file in a subprocess with
TRITON_INTERPRET=1, because Triton picks interpreter-or-compiler when @triton.jit
decorates a function (its own standard library included), i.e. at import time; a
subprocess keeps the switch from leaking into other tests of the same pytest run.
"""
import os

import pytest
import torch

from pagedserve.attention import reference
from paged_batch import make_batch

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("run through test_triton_interpret.py (needs TRITON_INTERPRET=1 before importing triton)",
                allow_module_level=True)

from interpreter_fixes import apply as _fix_interpreter  # noqa: E402  (tests/, shared with the fused ops)

_fix_interpreter()

from triton.runtime import interpreter  # noqa: E402

from pagedserve.attention import decode_plan, triton_ops as ops  # noqa: E402


def _reference_out(batch):
    kc, vc = batch.k_cache.clone(), batch.v_cache.clone()
    reference.write_kv(batch.new_k, batch.new_v, kc, vc, batch.meta.slot_mapping)
    return kc, vc, reference.paged_attention(batch.query, kc, vc, batch.meta, scale=batch.query.shape[-1] ** -0.5)


def _tol(dtype):
    return dict(rtol=1e-4, atol=1e-4) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)


def test_kernels_are_interpreted():
    assert isinstance(ops.paged_decode_kernel, interpreter.InterpretedFunction)


@pytest.mark.parametrize("block_size", [1, 8, 16])
def test_write_kv_matches_reference(block_size):
    batch = make_batch([(5, 1), (0, 7), (9, 4)], 1, H=4, Hkv=2, D=8, block_size=block_size)
    slots = batch.meta.slot_mapping.clone()
    slots[2] = -1  # a token whose K/V must not be written
    kc, vc = batch.k_cache.clone(), batch.v_cache.clone()
    reference.write_kv(batch.new_k, batch.new_v, kc, vc, slots)
    ops.write_kv(batch.new_k, batch.new_v, batch.k_cache, batch.v_cache, slots)
    assert torch.equal(batch.k_cache, kc) and torch.equal(batch.v_cache, vc)


def test_write_kv_from_strided_views_casts_dtype():
    batch = make_batch([(3, 5)], 0, H=2, Hkv=2, D=16, block_size=8, dtype=torch.bfloat16)
    qkv = torch.randn(5, 3, 2, 16)  # fp32 fused projection; key/value are non-contiguous views
    key, value = qkv[:, 1], qkv[:, 2]
    kc, vc = batch.k_cache.clone(), batch.v_cache.clone()
    reference.write_kv(key, value, kc, vc, batch.meta.slot_mapping)
    ops.write_kv(key, value, batch.k_cache, batch.v_cache, batch.meta.slot_mapping)
    # The interpreter rounds fp32 -> bf16 toward zero (the GPU rounds to nearest): one bf16 ulp apart.
    torch.testing.assert_close(batch.k_cache, kc, rtol=2 ** -7, atol=0)
    torch.testing.assert_close(batch.v_cache, vc, rtol=2 ** -7, atol=0)


@pytest.mark.parametrize("block_size", [1, 8, 16])
@pytest.mark.parametrize("H,Hkv,D", [(4, 4, 8), (8, 2, 16), (6, 1, 32)])
def test_mixed_batch_matches_reference(block_size, H, Hkv, D):
    """Decodes (one with a 1-token context), a fresh prefill and prefix-cached extends, GQA and MHA."""
    shapes = [(20, 1), (0, 1), (37, 1), (0, 19), (13, 6), (40, 1)]
    batch = make_batch(shapes, 3, H=H, Hkv=Hkv, D=D, block_size=block_size, seed=block_size + H)
    kc, vc, ref = _reference_out(batch)
    ops.write_kv(batch.new_k, batch.new_v, batch.k_cache, batch.v_cache, batch.meta.slot_mapping)
    out = ops.paged_attention(batch.query, batch.k_cache, batch.v_cache, batch.meta, scale=D ** -0.5)
    torch.testing.assert_close(out, ref, **_tol(torch.float32))
    # Into a given buffer (piecewise graphs pass their static one): every row written there.
    given = torch.full_like(batch.query, float("nan"))
    into = ops.paged_attention(batch.query, batch.k_cache, batch.v_cache, batch.meta, scale=D ** -0.5, out=given)
    assert into.data_ptr() == given.data_ptr()
    torch.testing.assert_close(given, out, rtol=0, atol=0)


@pytest.mark.parametrize("num_splits", [1, 3, 5])
def test_split_k_decode_matches_reference(num_splits):
    """Several splits, including empty ones for the short sequence, combined by the reduce kernel."""
    shapes = [(70, 1), (3, 1), (47, 1)]
    batch = make_batch(shapes, 3, H=8, Hkv=2, D=16, block_size=8, seed=num_splits)
    kc, vc, ref = _reference_out(batch)
    out = torch.empty_like(batch.query)
    m = batch.meta
    ops.paged_decode(batch.query, kc, vc, m.seq_lens, m.block_tables, m.max_seq_len, 16 ** -0.5, out,
                     num_splits=num_splits, block_n=16)
    torch.testing.assert_close(out, ref, **_tol(torch.float32))


@pytest.mark.parametrize("base,split_tokens", [(1, 0), (1, 16), (2, 16), (1, 40), (3, 64)])
def test_length_aware_splits_match_reference(base, split_tokens):
    """A decode graph's launch: the grid sized for max_model_len (4096, so up to MAX_SPLITS splits),
    lengths from 1 (a padded row) to 130; long sequences take more splits than the base, short
    ones one (written directly), and the programs past a sequence's last split write nothing."""
    shapes = [(129, 1), (0, 1), (2, 1), (46, 1), (15, 1), (100, 1)]
    batch = make_batch(shapes, 6, H=8, Hkv=2, D=16, block_size=8, seed=base + split_tokens)
    kc, vc, ref = _reference_out(batch)
    out = torch.full_like(batch.query, float("nan"))
    m = batch.meta
    ops.paged_decode(batch.query, kc, vc, m.seq_lens, m.block_tables, 4096, 16 ** -0.5, out,
                     num_splits=base, block_n=16, split_tokens=split_tokens)
    torch.testing.assert_close(out, ref, **_tol(torch.float32))


@pytest.mark.parametrize("base,share,min_chain", [(1, 4, 1), (1, 64, 2), (2, 8, 1), (1, 1000, 1)])
def test_balanced_splits_match_reference(base, share, min_chain):
    """The balanced plan (every program derives it from all of seq_lens): with the step's work
    shared over 4 programs the long sequences are cut into many splits, over 1000 none is; the
    reduce must agree on each."""
    shapes = [(129, 1), (0, 1), (2, 1), (46, 1), (15, 1), (100, 1), (300, 1)]
    batch = make_batch(shapes, 7, H=8, Hkv=2, D=16, block_size=8, seed=share + base)
    kc, vc, ref = _reference_out(batch)
    out = torch.full_like(batch.query, float("nan"))
    m = batch.meta
    ops.paged_decode(batch.query, kc, vc, m.seq_lens, m.block_tables, 4096, 16 ** -0.5, out,
                     num_splits=base, block_n=16, split_tokens=decode_plan.BALANCED, share_programs=share,
                     min_chain_tiles=min_chain)
    torch.testing.assert_close(out, ref, **_tol(torch.float32))


def test_balanced_slots_give_one_long_row_many_splits_among_260():
    """The slots' grid (SLOTS, slot_plan): 260 rows, more than one 256-row chunk of the plan's
    scans, in longest-first order (the long row at rank 0 shifts every later row's slots, and the
    rows of the second chunk find theirs past the carry; row order is
    test_balanced_grids_agree_on_a_skewed_step's), one long row and 259 of 1-3 tokens. With the work (272 tiles) shared over 300 programs the long row takes 13
    splits (one a 16-position tile) where the rows' grid has 5 a row, and every short row takes
    one slot. Every row must find its own splits, and the reduce the slots they went to."""
    shapes = [(1 + i % 3, 1) for i in range(260)]
    shapes[258] = (199, 1)
    batch = make_batch(shapes, 260, H=2, Hkv=1, D=16, block_size=8, seed=5)
    kc, vc, ref = _reference_out(batch)
    out = torch.full_like(batch.query, float("nan"))
    m = batch.meta
    cpu = torch.device("cpu")
    assert decode_plan.decode_launch(260, 1, 4096, cpu, num_splits=1, split_tokens=decode_plan.BALANCED)[1] == 5
    base, most, mode = decode_plan.decode_launch(260, 1, 4096, cpu, num_splits=1, split_tokens=decode_plan.SLOTS)
    assert (base, most, mode) == (1, 16, decode_plan.SLOTS)
    assert decode_plan.balanced_slots(260, 1, base, most, 300) == 560   # 300 + 260 slots
    ops.paged_decode(batch.query, kc, vc, m.seq_lens, m.block_tables, 4096, 16 ** -0.5, out,
                     num_splits=1, block_n=16, split_tokens=decode_plan.SLOTS, share_programs=300,
                     min_chain_tiles=1, order=ops.longest_first(m.seq_lens))
    torch.testing.assert_close(out, ref, **_tol(torch.float32))


@pytest.mark.parametrize("mode, max_len", [(decode_plan.SLOTS, 4096), (decode_plan.SLOTS, 8192),
                                           (decode_plan.BALANCED, 4096)])
@pytest.mark.parametrize("longest_first", [False, True])
def test_balanced_grids_agree_on_a_skewed_step(mode, max_len, longest_first):
    """One long row among short ones, the balanced cut in the slots' grid and in the rows': the
    same outputs, each the reference's. At max_len 8192 the slots' grid allows 32 splits a row,
    and the long row's 22 non-empty ones take the reduce two passes of REDUCE_BLOCK_S. (Shapes
    where the rows' grid binds need thousands of programs, too slow for the interpreter:
    decode_plan.takes_slots is checked on them in test_split_plan.py, and test_triton_gpu.py runs
    one on the GPU.)"""
    shapes = [(3 + 5 * i, 1) for i in range(9)]
    shapes[4] = (700, 1)
    batch = make_batch(shapes, 9, H=8, Hkv=2, D=16, block_size=8, seed=3)
    kc, vc, ref = _reference_out(batch)
    m = batch.meta
    out = torch.full_like(batch.query, float("nan"))
    order = ops.longest_first(m.seq_lens) if longest_first else None
    if max_len == 8192:
        assert decode_plan.decode_launch(9, 2, max_len, torch.device("cpu"), num_splits=1, split_tokens=mode)[1] == 32
        assert decode_plan.reduce_block(32, mode) == decode_plan.REDUCE_BLOCK_S == 16
    ops.paged_decode(batch.query, kc, vc, m.seq_lens, m.block_tables, max_len, 16 ** -0.5, out,
                     num_splits=1, block_n=16, split_tokens=mode, share_programs=200, min_chain_tiles=1,
                     order=order)
    torch.testing.assert_close(out, ref, **_tol(torch.float32))


@pytest.mark.parametrize("split_tokens", [0, 16, decode_plan.BALANCED, decode_plan.SLOTS])
# (False, False), the plain order, is not repeated here: it is test_length_aware_splits_match_reference
# (split_tokens 0 and 16) and test_balanced_splits_match_reference's (1, 4, 1) (BALANCED, 4 programs'
# share, chains of 1): the same launch in the plain order, on (nearly) the same lengths.
@pytest.mark.parametrize("heads_fastest,longest_first", [(True, False), (False, True), (True, True)])
def test_program_order_variants_match_reference(split_tokens, heads_fastest, longest_first):
    """The grid with KV heads as its fastest axis, and rows mapped through a longest-first order
    (as the runner passes it), give the same outputs: each program still finds its own sequence,
    head and split, and the reduce its splits."""
    shapes = [(129, 1), (0, 1), (2, 1), (46, 1), (15, 1), (100, 1), (300, 1)]
    batch = make_batch(shapes, 7, H=8, Hkv=2, D=16, block_size=8, seed=11 + split_tokens)
    kc, vc, ref = _reference_out(batch)
    out = torch.full_like(batch.query, float("nan"))
    m = batch.meta
    order = ops.longest_first(m.seq_lens) if longest_first else None
    ops.paged_decode(batch.query, kc, vc, m.seq_lens, m.block_tables, 4096, 16 ** -0.5, out,
                     num_splits=1, block_n=16, split_tokens=split_tokens, share_programs=4, min_chain_tiles=1,
                     heads_fastest=heads_fastest, order=order)
    torch.testing.assert_close(out, ref, **_tol(torch.float32))


# bf16 is left to test_triton_gpu.py: the 3.6 interpreter's tl.dot multiplies bf16 bit patterns as integers.
@pytest.mark.parametrize("dtype", [torch.float16])
def test_half_precision_matches_reference(dtype):
    batch = make_batch([(25, 1), (0, 9), (11, 5)], 1, H=4, Hkv=2, D=16, block_size=8, dtype=dtype)
    kc, vc, ref = _reference_out(batch)
    out = ops.paged_attention(batch.query, kc, vc, batch.meta, scale=0.25)
    torch.testing.assert_close(out.float(), ref.float(), **_tol(dtype))


@pytest.mark.parametrize("lpt", [False, True])
def test_prefill_tiles_span_the_diagonal(lpt):
    """Query tiles smaller than the chunk: the unmasked/causal split and partial tiles at both ends;
    lpt: the same tiles started last first."""
    batch = make_batch([(21, 27), (0, 33)], 0, H=2, Hkv=1, D=8, block_size=8, seed=7)
    kc, vc, ref = _reference_out(batch)
    m = batch.meta
    out = torch.empty_like(batch.query)
    ops.paged_prefill(batch.query, kc, vc, m.query_start_loc, m.seq_lens, m.block_tables, 0, 2,
                      m.max_query_len, 8 ** -0.5, out, block_m=16, block_n=16, lpt=lpt)
    torch.testing.assert_close(out, ref, **_tol(torch.float32))


@pytest.mark.parametrize("block_size", [1, 16])
def test_copy_blocks_matches_reference(block_size):
    gen = torch.Generator().manual_seed(block_size)
    layers = [(torch.randn(6, block_size, 2, 8, generator=gen), torch.randn(6, block_size, 2, 8, generator=gen))
              for _ in range(2)]
    pairs = [(0, 3), (0, 4), (5, 1)]
    expect = [(k.clone(), v.clone()) for k, v in layers]
    reference.copy_blocks([k for k, _ in expect], [v for _, v in expect], pairs)
    ops.copy_blocks([k for k, _ in layers], [v for _, v in layers], pairs)
    for (k, v), (ek, ev) in zip(layers, expect):
        assert torch.equal(k, ek) and torch.equal(v, ev)


def test_choose_num_splits_fills_the_gpu():
    cpu = torch.device("cpu")
    assert decode_plan.choose_num_splits(64, 8, 4096, cpu) * 64 * 8 >= decode_plan.DECODE_PROGRAMS_PER_SM * 132
    few = decode_plan.choose_num_splits(2, 8, 32768, cpu)
    assert few * 2 * 8 >= decode_plan.DECODE_PROGRAMS_PER_SM * 132
    assert decode_plan.choose_num_splits(2, 8, 100, cpu) == 1


# --- FP8 KV cache: e4m3 pools with per-layer scales -------------------------------------------------
def _fp8_pools(batch, k_scale, v_scale):
    from pagedserve.attention.kv_quant import quantize_kv
    return quantize_kv(batch.k_cache, k_scale), quantize_kv(batch.v_cache, v_scale)


def _write_kv_bit_exact(batch, kc, vc, slots, ks, vs):
    """The Triton cache write into (kc, vc) leaves the same bytes as the reference's into copies."""
    rk, rv = kc.clone(), vc.clone()
    reference.write_kv(batch.new_k, batch.new_v, rk, rv, slots, ks, vs)
    ops.write_kv(batch.new_k, batch.new_v, kc, vc, slots, ks, vs)
    assert torch.equal(kc.view(torch.uint8), rk.view(torch.uint8))
    assert torch.equal(vc.view(torch.uint8), rv.view(torch.uint8))


def test_fp8_write_kv_quantizes_like_reference_bit_exact():
    batch = make_batch([(5, 1), (0, 7), (9, 4)], 1, H=4, Hkv=2, D=8, block_size=8, seed=3)
    ks, vs = torch.tensor([0.03]), torch.tensor([0.002])  # V's scale pushes some values to +-448, some subnormal
    kc, vc = _fp8_pools(batch, ks, vs)
    slots = batch.meta.slot_mapping.clone()
    slots[2] = -1
    _write_kv_bit_exact(batch, kc, vc, slots, ks, vs)


@pytest.mark.parametrize("qdtype,num_splits", [(torch.float32, None), (torch.float32, 3), (torch.float16, None)])
def test_fp8_paged_attention_matches_attention_over_dequantized_kv(qdtype, num_splits):
    """Decodes (split-K too) and prefill/extends read e4m3 blocks and dequantize in registers; the oracle
    is the reference over float32 pools holding the dequantized values."""
    batch = make_batch([(20, 1), (37, 1), (0, 9), (13, 6)], 2, H=4, Hkv=2, D=16, block_size=8, seed=5)
    ks, vs = torch.tensor([0.03]), torch.tensor([0.02])
    kc, vc = _fp8_pools(batch, ks, vs)
    ops.write_kv(batch.new_k, batch.new_v, kc, vc, batch.meta.slot_mapping, ks, vs)
    ref = reference.paged_attention(batch.query, kc.float() * ks, vc.float() * vs, batch.meta, scale=0.25)
    out = ops.paged_attention(batch.query.to(qdtype), kc, vc, batch.meta, 0.25, num_splits=num_splits,
                              k_scale=ks, v_scale=vs)
    torch.testing.assert_close(out.float(), ref, **_tol(qdtype))
    # and the reference backend reading the same fp8 pools agrees with itself over dequantized ones
    own = reference.paged_attention(batch.query, kc, vc, batch.meta, 0.25, k_scale=ks, v_scale=vs)
    torch.testing.assert_close(own, ref, rtol=1e-5, atol=1e-6)


def test_fp8_copy_blocks_moves_bytes():
    batch = make_batch([(10, 1)], 1, H=2, Hkv=2, D=8, block_size=4, seed=7)
    kc, vc = _fp8_pools(batch, torch.tensor([0.05]), torch.tensor([0.05]))
    want_k, want_v = kc.clone(), vc.clone()
    want_k[[2, 0]] = kc[[1, 3]]
    want_v[[2, 0]] = vc[[1, 3]]
    ops.copy_blocks([kc], [vc], [(1, 2), (3, 0)])
    assert torch.equal(kc.view(torch.uint8), want_k.view(torch.uint8))
    assert torch.equal(vc.view(torch.uint8), want_v.view(torch.uint8))


# Per-KV-head scales, 40x apart between heads: a kernel that read one head's scale for all (or the
# wrong head's) would be far off. Three KV heads, so the cache write's head block (4) is masked.
PER_HEAD_K, PER_HEAD_V = torch.tensor([0.002, 0.08, 0.03]), torch.tensor([0.05, 0.00125, 0.01])


def test_fp8_per_head_write_kv_bit_exact():
    from pagedserve.attention.kv_quant import quantize_kv
    batch = make_batch([(5, 1), (0, 7), (9, 4)], 1, H=6, Hkv=3, D=8, block_size=8, seed=11)
    ks, vs = PER_HEAD_K, PER_HEAD_V
    kc, vc = _fp8_pools(batch, ks, vs)
    slots = batch.meta.slot_mapping.clone()
    slots[2] = -1
    _write_kv_bit_exact(batch, kc, vc, slots, ks, vs)
    # each head's bytes are that head alone quantized with its own scale
    kept = slots >= 0
    for h in range(3):
        want = quantize_kv(batch.new_k[kept, h:h + 1], ks[h:h + 1]).view(torch.uint8)
        assert torch.equal(kc.view(torch.uint8).flatten(0, 1)[slots[kept], h:h + 1], want)


@pytest.mark.parametrize("qdtype,num_splits", [(torch.float32, None), (torch.float32, 3), (torch.float16, None)])
def test_fp8_per_head_scales_match_attention_over_dequantized_kv(qdtype, num_splits):
    """Decode (split-K too) and prefill/extend kernels with [num_kv_heads] scales, GQA group 2."""
    batch = make_batch([(20, 1), (37, 1), (0, 9), (13, 6)], 2, H=6, Hkv=3, D=16, block_size=8, seed=12)
    ks, vs = PER_HEAD_K, PER_HEAD_V
    kc, vc = _fp8_pools(batch, ks, vs)
    ops.write_kv(batch.new_k, batch.new_v, kc, vc, batch.meta.slot_mapping, ks, vs)
    ref = reference.paged_attention(batch.query, kc.float() * ks[:, None], vc.float() * vs[:, None], batch.meta,
                                    scale=0.25)
    out = ops.paged_attention(batch.query.to(qdtype), kc, vc, batch.meta, 0.25, num_splits=num_splits,
                              k_scale=ks, v_scale=vs)
    torch.testing.assert_close(out.float(), ref, **_tol(qdtype))
    own = reference.paged_attention(batch.query, kc, vc, batch.meta, 0.25, k_scale=ks, v_scale=vs)
    torch.testing.assert_close(own, ref, rtol=1e-5, atol=1e-6)
    # the heads' scales matter: reading every head with head 0's is nowhere near
    wrong = reference.paged_attention(batch.query, kc, vc, batch.meta, 0.25, k_scale=ks[:1], v_scale=vs[:1])
    assert (wrong - ref).abs().max() > 0.1


# --- The GQA-packed prefill variant (triton_prefill.py, PAGEDSERVE_PREFILL_LAUNCH's gqa) ----------
@pytest.mark.parametrize("lpt", [False, True])
@pytest.mark.parametrize("block_size,H,Hkv,D,block_m", [
    (8, 4, 4, 64, 16),     # MHA: packing is a no-op (the plain kernel runs)
    (16, 8, 2, 128, 32),   # group 4: 8 tokens x 4 heads per tile
    (8, 8, 1, 64, 16),     # group 8: 2 tokens per tile, every tile on the diagonal
    (16, 6, 1, 32, 32),    # group 6 padded to 8: padded rows must not be written
])
def test_gqa_packed_prefill_matches_reference(block_size, H, Hkv, D, block_m, lpt):
    """Chunks crossing block boundaries, with and without prefix context, one shorter than a tile;
    each row's causal mask follows its own token. The rows of other sequences (a decode first)
    stay as they were: NaN. lpt: the tiles in reverse order (the short chunk's past its end)."""
    shapes = [(9, 1), (21, 27), (0, 33), (5, 3)]
    batch = make_batch(shapes, 1, H=H, Hkv=Hkv, D=D, block_size=block_size, seed=H + D)
    kc, vc, ref = _reference_out(batch)
    m = batch.meta
    out = torch.full_like(batch.query, float("nan"))
    ops.paged_prefill(batch.query, kc, vc, m.query_start_loc, m.seq_lens, m.block_tables, 1, 3,
                      max(m.query_lens_cpu[1:]), D ** -0.5, out, block_m=block_m, block_n=16, gqa=True, lpt=lpt)
    assert out[:1].isnan().all()
    torch.testing.assert_close(out[1:], ref[1:], **_tol(torch.float32))


def test_gqa_packed_prefill_fp8_per_head_scales():
    """Each KV head's own scales in the packed tile (group 2; scales 40x apart between heads)."""
    batch = make_batch([(20, 9), (0, 13)], 0, H=6, Hkv=3, D=16, block_size=8, seed=13)
    ks, vs = PER_HEAD_K, PER_HEAD_V
    kc, vc = _fp8_pools(batch, ks, vs)
    ops.write_kv(batch.new_k, batch.new_v, kc, vc, batch.meta.slot_mapping, ks, vs)
    ref = reference.paged_attention(batch.query, kc.float() * ks[:, None], vc.float() * vs[:, None], batch.meta,
                                    scale=0.25)
    m = batch.meta
    out = torch.empty_like(batch.query)
    ops.paged_prefill(batch.query, kc, vc, m.query_start_loc, m.seq_lens, m.block_tables, 0, 2, m.max_query_len,
                      0.25, out, block_m=16, block_n=16, gqa=True, k_scale=ks, v_scale=vs)
    torch.testing.assert_close(out, ref, **_tol(torch.float32))


# --- The TMA prefill variant (PAGEDSERVE_PREFILL_LAUNCH's tma, ws) ---------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])  # bf16: test_triton_gpu.py (see above)
@pytest.mark.parametrize("block_size,block_n,H,Hkv,D,gqa,ws", [
    (32, 16, 8, 2, 32, False, False),   # two tiles a page
    (16, 16, 8, 2, 32, True, False),    # one tile a page, packed rows
    (64, 32, 4, 4, 16, False, True),    # MHA, ws (the interpreter ignores it: the same result)
])
def test_tma_prefill_matches_reference(dtype, block_size, block_n, H, Hkv, D, gqa, ws):
    """Each K/V tile one descriptor load of its page: chunks crossing pages, with and without
    prefix context, one shorter than a tile; slots past each sequence's end hold NaN, which the
    causal tail must neither score nor sum (the gather path masks its loads instead)."""
    shapes = [(9, 1), (21, 27), (0, 33), (5, 3), (70, 40)]
    batch = make_batch(shapes, 1, H=H, Hkv=Hkv, D=D, block_size=block_size, dtype=dtype, seed=block_size + D)
    kc, vc, ref = _reference_out(batch)
    m = batch.meta
    live = torch.zeros(kc.shape[0] * block_size, dtype=torch.bool)
    for row, n in zip(m.block_tables.tolist(), m.seq_lens.tolist()):
        for p in range(n):
            live[row[p // block_size] * block_size + p % block_size] = True
    dead = ~live.view(kc.shape[0], block_size)
    kc[dead], vc[dead] = float("nan"), float("nan")
    out = torch.full_like(batch.query, float("nan"))
    ops.paged_prefill(batch.query, kc, vc, m.query_start_loc, m.seq_lens, m.block_tables, 1, 4,
                      max(m.query_lens_cpu[1:]), D ** -0.5, out, block_m=32, block_n=block_n, gqa=gqa,
                      tma=True, ws=ws)
    assert out[:1].isnan().all()
    torch.testing.assert_close(out[1:].float(), ref[1:].float(), **_tol(dtype))


@pytest.mark.parametrize("block_size, kw, match", [
    (8, dict(block_n=16), "multiple of bn"),     # a tile would span two pages
    (16, dict(block_n=16, ws=True, tma=False), "add tma"),
])
def test_tma_prefill_refuses_what_it_cannot_serve(block_size, kw, match):
    batch = make_batch([(3, 5)], 0, H=2, Hkv=2, D=16, block_size=block_size)
    m = batch.meta
    with pytest.raises(ValueError, match=match):
        ops.paged_prefill(batch.query, batch.k_cache, batch.v_cache, m.query_start_loc, m.seq_lens, m.block_tables,
                          0, 1, 5, 0.25, torch.empty_like(batch.query), block_m=16, **{"tma": True, **kw})


@pytest.mark.parametrize("merge,first,prefix_gqa", [("torch", 0, False), ("triton", 0, False), ("torch", 9, False),
                                                    ("triton", 9, False), ("triton", 9, True)])
def test_long_chunks_take_the_gathered_path_beside_the_kernels(monkeypatch, merge, first, prefix_gqa):
    """PAGEDSERVE_LONG_PREFILL=cudnn's routing: a step of decodes, short chunks and two long ones
    (not adjacent) gives reference.py's output, the long chunks through gathered_prefill (its CUDA
    ops stood in for by plain attention: tests/attention/test_gathered_prefill.py) and every other
    sequence through the Triton kernels, in the ranges between; the parts merged by torch ops or
    by triton_merge's kernel (PAGEDSERVE_LONG_PREFILL_MERGE) straight into the layer's output, the
    queries folded likewise by torch ops or triton_fold's kernel (PAGEDSERVE_LONG_PREFILL_FOLD);
    with PAGEDSERVE_LONG_PREFILL_FIRST=9, the chunks of 9+ tokens after fewer than 32 too.
    prefix_gqa (PAGEDSERVE_LONG_PREFILL_PREFIX=gqa): cuDNN's parts take the queries unfolded, the
    flash tails folded, so the merge kernel meets parts of both layouts."""
    from pagedserve.attention import gathered_prefill as gp, gathered_prefill_plan as plan
    from pagedserve.attention.triton_fold import fold_into
    from pagedserve.attention.triton_merge import merge_into
    from test_gathered_prefill import math_causal, math_flash, math_prefix
    for name, value in (("PREFIX_BUCKET", 32), ("QUERY_BUCKET", 8), ("MIN_PREFIX", 40), ("MIN_CHUNK", 4)):
        monkeypatch.setattr(plan, name, value)
    shapes = [(20, 1), (37, 1), (50, 6), (3, 5), (77, 13), (45, 2), (41, 4), (0, 12), (20, 9), (33, 10)]
    batch = make_batch(shapes, 2, H=8, Hkv=2, D=16, block_size=8, seed=3)
    kc, vc, ref = _reference_out(batch)
    g = gp.GatheredPrefill(128, 2, 16, torch.float32, torch.device("cpu"), math_prefix, math_flash,
                           math_causal, merge_into=merge_into if merge == "triton" else None,
                           fold_into=fold_into if merge == "triton" else None, first_chunk_tokens=first,
                           prefix_gqa=prefix_gqa)
    if prefix_gqa:
        g.gqa_q_row_stride = batch.query.stride(0)  # as the warm-up registers the model's
    monkeypatch.setitem(gp._ACTIVE, kc.device, g)
    used = []
    attend = g.attend
    monkeypatch.setattr(g, "attend", lambda q, *a, **kw: used.append(q.shape[0]) or attend(q, *a, **kw))
    out = ops.paged_attention(batch.query, kc, vc, batch.meta, scale=0.25)
    torch.testing.assert_close(out, ref, **_tol(torch.float32))
    assert used == ([6, 13, 4, 12, 9] if first else [6, 13, 4])  # (33, 10): a prefix head, under MIN_PREFIX


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("c,rows,D", [(13, 16, 16), (40, 40, 8), (1, 40, 32), (33, 64, 12)])
def test_fold_kernel_matches_the_torch_fold(dtype, c, rows, D):
    """triton_fold.fold_into against the permuted copy it replaces: queries as rows of a wider qkv
    (row stride past the heads), folded heads first into [H, rows, D] with the padding rows past c
    zeroed (the output starts as NaN: nothing stale may stay), over several row tiles; a head_dim
    that is not a power of two; outputs of another shape or layout are refused."""
    from pagedserve.attention.triton_fold import fold_into
    g = torch.Generator().manual_seed(c * 10 + D)
    H, Hkv = 6, 2
    qkv = torch.randn(c, (H + 2 * Hkv) * D, generator=g).to(dtype)
    q = qkv[:, :H * D].view(c, H, D)
    want = torch.zeros(H, rows, D, dtype=dtype)
    want[:, :c] = q.transpose(0, 1)
    out = torch.full((H, rows, D), float("nan"), dtype=dtype)
    assert fold_into(q, out) is out
    assert torch.equal(out, want)
    with pytest.raises(ValueError, match="contiguous"):
        fold_into(q, torch.empty(H, c - 1, D, dtype=dtype) if c > 1 else torch.empty(H + 1, rows, D, dtype=dtype))
    with pytest.raises(ValueError, match="contiguous"):
        fold_into(q, torch.empty(rows, H, D, dtype=dtype).transpose(0, 1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("num_parts,c,rows,D", [(2, 13, 16, 16), (3, 40, 40, 8), (3, 1, 8, 32), (2, 33, 40, 12)])
def test_merge_kernel_matches_the_torch_merge(dtype, num_parts, c, rows, D):
    """triton_merge.merge_into against gathered_prefill.merge: parts of [H, rows, D] with their
    log-sum-exps far apart (one part dominating some rows), the first c rows (c < rows: the query
    bucket's padding is skipped) written into a strided slice of a [tokens, H, D] output, and
    nothing else of it touched; a head_dim that is not a power of two."""
    from pagedserve.attention.gathered_prefill import merge
    from pagedserve.attention.triton_merge import merge_into
    g = torch.Generator().manual_seed(num_parts * 100 + c)
    H = 6
    parts = [(torch.randn(H, rows, D, generator=g).to(dtype), torch.randn(H, rows, generator=g) * 8)
             for _ in range(num_parts)]
    want = merge(parts)[:, :c].transpose(0, 1)
    layer_out = torch.full((c + 7, H, D), 7.0, dtype=dtype)
    got = merge_into(parts, layer_out[3:3 + c])
    assert got.data_ptr() == layer_out[3].data_ptr()
    torch.testing.assert_close(got, want, **_tol(dtype))
    assert (layer_out[:3] == 7).all() and (layer_out[3 + c:] == 7).all()
    with pytest.raises(ValueError, match="2 or 3 parts"):
        merge_into(parts[:1], layer_out[3:3 + c])
    # parts laid out otherwise (D and the rows of a log-sum-exp not innermost) are made so first
    odd = [(o.transpose(1, 2).contiguous().transpose(1, 2), lse.t().contiguous().t()) for o, lse in parts]
    torch.testing.assert_close(merge_into(odd, torch.empty(c, H, D, dtype=dtype)), want, **_tol(dtype))
