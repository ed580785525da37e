"""The compiled Triton kernels match reference.py on the GPU at Llama-3.1-8B attention sizes.

32 query heads, 8 KV heads, head_dim 128 (plus head_dim 64 and MHA), bf16 by default.
Skipped without CUDA; CPU CI covers the same kernels through the interpreter.
"""
import pytest
import torch

from pagedserve.attention import decode_plan, reference
from paged_batch import make_batch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

TOL = {torch.bfloat16: dict(rtol=2e-2, atol=2e-2), torch.float16: dict(rtol=5e-3, atol=5e-3),
       torch.float32: dict(rtol=1e-4, atol=1e-4)}


@pytest.fixture(scope="module")
def ops():
    from pagedserve.attention import triton_ops
    return triton_ops


def _written(batch):
    kc, vc = batch.k_cache.clone(), batch.v_cache.clone()
    reference.write_kv(batch.new_k, batch.new_v, kc, vc, batch.meta.slot_mapping)
    return kc, vc


def _poison_dead_slots(kc, vc, meta):
    """NaN in every pool slot no sequence of the batch holds (past each end, spare blocks)."""
    bs = kc.shape[1]
    live = torch.zeros(kc.shape[0] * bs, dtype=torch.bool, device=kc.device)
    for row, n in zip(meta.block_tables.tolist(), meta.seq_lens.tolist()):
        pos = torch.arange(n, device=kc.device)
        live[torch.tensor(row, device=kc.device)[pos // bs] * bs + pos % bs] = True
    dead = ~live.view(kc.shape[0], bs)
    kc[dead], vc[dead] = float("nan"), float("nan")


MIXED = [(1500, 1), (0, 1), (4095, 1), (77, 1), (300, 1), (0, 512), (1000, 333), (2048, 64), (5, 1)]


@pytest.mark.parametrize("block_size", [1, 16, 256])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_mixed_batch_llama8b_shape(ops, block_size, dtype):
    batch = make_batch(MIXED, 5, H=32, Hkv=8, D=128, block_size=block_size, dtype=dtype, device="cuda")
    kc, vc = _written(batch)
    ref = reference.paged_attention(batch.query, kc, vc, batch.meta, scale=128 ** -0.5)
    ops.write_kv(batch.new_k, batch.new_v, batch.k_cache, batch.v_cache, batch.meta.slot_mapping)
    assert torch.equal(batch.k_cache, kc) and torch.equal(batch.v_cache, vc)
    out = ops.paged_attention(batch.query, batch.k_cache, batch.v_cache, batch.meta, scale=128 ** -0.5)
    torch.testing.assert_close(out.float(), ref.float(), **TOL[dtype])


@pytest.mark.parametrize("block_size", [8, 32, 64, 128])
@pytest.mark.parametrize("H,Hkv,D", [(32, 8, 128), (16, 16, 64), (28, 4, 128), (14, 2, 64)])
def test_shapes_and_block_sizes(ops, block_size, H, Hkv, D):
    shapes = [(700, 1), (33, 1), (0, 200), (450, 129)]
    batch = make_batch(shapes, 2, H=H, Hkv=Hkv, D=D, block_size=block_size, dtype=torch.bfloat16,
                       device="cuda", seed=block_size)
    kc, vc = _written(batch)
    ref = reference.paged_attention(batch.query, kc, vc, batch.meta, scale=D ** -0.5)
    out = ops.paged_attention(batch.query, kc, vc, batch.meta, scale=D ** -0.5)
    torch.testing.assert_close(out.float(), ref.float(), **TOL[torch.bfloat16])


@pytest.mark.parametrize("num_splits", [1, 2, 7, 16, 64])
def test_split_k_decode(ops, num_splits):
    shapes = [(8191, 1), (16, 1), (3000, 1)]
    batch = make_batch(shapes, 3, H=32, Hkv=8, D=128, block_size=16, dtype=torch.bfloat16, device="cuda")
    kc, vc = _written(batch)
    ref = reference.paged_attention(batch.query, kc, vc, batch.meta, scale=128 ** -0.5)
    m = batch.meta
    out = torch.empty_like(batch.query)
    ops.paged_decode(batch.query, kc, vc, m.seq_lens, m.block_tables, m.max_seq_len, 128 ** -0.5, out,
                     num_splits=num_splits)
    torch.testing.assert_close(out.float(), ref.float(), **TOL[torch.bfloat16])


@pytest.mark.parametrize("base", [1, 4])
@pytest.mark.parametrize("split_tokens", [0, 64, 512, -1])  # -1: balanced
def test_length_aware_splits(ops, base, split_tokens):
    """As a decode graph launches it: the grid sized for 8192 positions, contexts from 1 to 4096."""
    shapes = [(4095, 1), (0, 1), (700, 1), (63, 1), (2047, 1), (511, 1), (1500, 1)]
    batch = make_batch(shapes, 7, H=32, Hkv=8, D=128, block_size=16, dtype=torch.bfloat16, device="cuda")
    kc, vc = _written(batch)
    ref = reference.paged_attention(batch.query, kc, vc, batch.meta, scale=128 ** -0.5)
    m = batch.meta
    out = torch.full_like(batch.query, float("nan"))
    ops.paged_decode(batch.query, kc, vc, m.seq_lens, m.block_tables, 8192, 128 ** -0.5, out,
                     num_splits=base, split_tokens=split_tokens)
    torch.testing.assert_close(out.float(), ref.float(), **TOL[torch.bfloat16])


@pytest.mark.parametrize("mode", [decode_plan.SLOTS, decode_plan.BALANCED])
@pytest.mark.parametrize("longest_first", [False, True])
def test_balanced_long_context_beside_short_ones(ops, longest_first, mode):
    """The mix the balanced grid of slots is for: one 32k-token context decoding beside 15 short
    ones, launched as a 16-row decode graph launches it (max_model_len 40,960), the long one cut
    into ~43 splits and every short one into its base: all of them in the grid's slots; and the
    same cut in the rows' grid (9 splits a row)."""
    shapes = [(300 + 37 * i, 1) for i in range(16)]
    shapes[3] = (32767, 1)
    batch = make_batch(shapes, 16, H=32, Hkv=8, D=128, block_size=16, dtype=torch.bfloat16, device="cuda")
    kc, vc = _written(batch)
    ref = reference.paged_attention(batch.query, kc, vc, batch.meta, scale=128 ** -0.5)
    m = batch.meta
    out = torch.full_like(batch.query, float("nan"))
    order = ops.longest_first(m.seq_lens) if longest_first else None
    ops.paged_decode(batch.query, kc, vc, m.seq_lens, m.block_tables, 40960, 128 ** -0.5, out,
                     split_tokens=mode, order=order)
    torch.testing.assert_close(out.float(), ref.float(), **TOL[torch.bfloat16])


def test_write_kv_casts_like_torch(ops):
    batch = make_batch([(10, 20), (3, 1)], 0, H=32, Hkv=8, D=128, block_size=16, dtype=torch.bfloat16,
                       device="cuda")
    qkv = torch.randn(21, 48, 128, device="cuda")  # fused fp32 projection: K and V are strided views
    key, value = qkv[:, 32:40], qkv[:, 40:48]
    slots = batch.meta.slot_mapping.clone()
    slots[::3] = -1
    kc, vc = batch.k_cache.clone(), batch.v_cache.clone()
    reference.write_kv(key, value, kc, vc, slots)
    ops.write_kv(key, value, batch.k_cache, batch.v_cache, slots)
    assert torch.equal(batch.k_cache, kc) and torch.equal(batch.v_cache, vc)


@pytest.mark.parametrize("block_size", [1, 16, 256])
def test_copy_blocks_all_layers(ops, block_size):
    layers = [(torch.randn(40, block_size, 8, 128, device="cuda", dtype=torch.bfloat16),
               torch.randn(40, block_size, 8, 128, device="cuda", dtype=torch.bfloat16)) for _ in range(4)]
    pairs = [(0, 39), (0, 38), (5, 6), (20, 1)]
    expect = [(k.clone(), v.clone()) for k, v in layers]
    reference.copy_blocks([k for k, _ in expect], [v for _, v in expect], pairs)
    ops.copy_blocks([k for k, _ in layers], [v for _, v in layers], pairs)
    for (k, v), (ek, ev) in zip(layers, expect):
        assert torch.equal(k, ek) and torch.equal(v, ev)


def test_decode_is_capturable_in_a_cuda_graph(ops):
    """The runner replays decode steps as CUDA graphs: the kernels must capture and replay correctly."""
    batch = make_batch([(900, 1), (40, 1)], 2, H=32, Hkv=8, D=128, block_size=16, dtype=torch.bfloat16,
                       device="cuda")
    kc, vc = _written(batch)
    ref = reference.paged_attention(batch.query, kc, vc, batch.meta, scale=128 ** -0.5)
    for num_splits in (1, 4):
        ops.paged_attention(batch.query, kc, vc, batch.meta, scale=128 ** -0.5, num_splits=num_splits)  # compile
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = ops.paged_attention(batch.query, kc, vc, batch.meta, scale=128 ** -0.5, num_splits=num_splits)
        out.zero_()
        graph.replay()
        torch.testing.assert_close(out.float(), ref.float(), **TOL[torch.bfloat16])


# Not bm128+bn64+w4+s2+gqa+tma+ws: Triton 3.6's warp-specialisation pass fails to compile it on the
# H200 (2026-12-03, docs/long-context.md).
@pytest.mark.parametrize("launch", ["bm128+bn128+w8+s4+tma", "bm128+bn64+w8+s3+gqa+tma", "bm128+bn128+w8+s3+tma+ws",
                                    "bm128+bn128+w8+s3+tma+ws+lpt"])
@pytest.mark.parametrize("H,Hkv,D", [(32, 8, 128), (14, 2, 64)])
def test_tma_prefill_launches(ops, launch, H, Hkv, D):
    """The tma variant (K/V tiles by descriptor, one page each) over 128-token pages, warp-specialised
    or not, in bf16 (the interpreter cases cover fp32/fp16); slots past each sequence's end are NaN."""
    from pagedserve.attention.triton_prefill import parse_prefill_launch
    shapes = [(0, 700), (1000, 333), (2048, 64), (5, 1)]
    batch = make_batch(shapes, 0, H=H, Hkv=Hkv, D=D, block_size=128, dtype=torch.bfloat16, device="cuda", seed=5)
    kc, vc = _written(batch)
    m = batch.meta
    ref = reference.paged_attention(batch.query, kc, vc, m, scale=D ** -0.5)
    _poison_dead_slots(kc, vc, m)
    chosen = parse_prefill_launch(launch)
    out = torch.full_like(batch.query, float("nan"))
    ops.paged_prefill(batch.query, kc, vc, m.query_start_loc, m.seq_lens, m.block_tables, 0, len(shapes),
                      m.max_query_len, D ** -0.5, out, block_m=chosen.block_m, block_n=chosen.block_n,
                      num_warps=chosen.num_warps, num_stages=chosen.num_stages, gqa=chosen.gqa, tma=True, ws=chosen.ws)
    torch.testing.assert_close(out.float(), ref.float(), **TOL[torch.bfloat16])


@pytest.mark.parametrize("launch", ["bm64+bn64+w4+s2+gqa", "bm128+bn64+w8+s3+gqa+lpt", "bm128+bn128+w8+s2+lpt"])
@pytest.mark.parametrize("H,Hkv,D", [(32, 8, 128), (28, 4, 128), (14, 2, 64)])
def test_prefill_launches(ops, launch, H, Hkv, D):
    """PAGEDSERVE_PREFILL_LAUNCH candidates the sweep (benchmarks/kernels/prefill_sweep.py) may pick,
    the GQA-packed variant (a group of 7 padded to 8) and longest-first tiles included, over chunks
    with and without context."""
    from pagedserve.attention.triton_prefill import parse_prefill_launch
    shapes = [(0, 700), (1000, 333), (2048, 64), (5, 1)]
    batch = make_batch(shapes, 0, H=H, Hkv=Hkv, D=D, block_size=16, dtype=torch.bfloat16, device="cuda", seed=3)
    kc, vc = _written(batch)
    m = batch.meta
    ref = reference.paged_attention(batch.query, kc, vc, m, scale=D ** -0.5)
    chosen = parse_prefill_launch(launch)
    out = torch.full_like(batch.query, float("nan"))
    ops.paged_prefill(batch.query, kc, vc, m.query_start_loc, m.seq_lens, m.block_tables, 0, len(shapes),
                      m.max_query_len, D ** -0.5, out, block_m=chosen.block_m, block_n=chosen.block_n,
                      num_warps=chosen.num_warps, num_stages=chosen.num_stages, gqa=chosen.gqa, lpt=chosen.lpt)
    torch.testing.assert_close(out.float(), ref.float(), **TOL[torch.bfloat16])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("buckets", ["small", "serving"])
def test_gathered_prefill_reads_runs_in_place(ops, monkeypatch, dtype, buckets):
    """Pages in one run of the pool (a fresh pool's prompts; AttentionMetadata.page_runs) are read
    in place by cuDNN (PAGEDSERVE_LONG_PREFILL_GATHER=runs): the same chunks as the test below,
    equal to the reference, within float rounding of the gathered path, and nothing gathered (the
    buffers past the largest padded square stay NaN)."""
    from pagedserve.attention import gathered_prefill as gp, gathered_prefill_plan as plan
    from pagedserve.attention.triton_fold import fold_into
    from pagedserve.attention.triton_merge import merge_into
    if buckets == "small":
        for name, value in (("PREFIX_BUCKET", 256), ("QUERY_BUCKET", 128), ("MIN_PREFIX", 512), ("MIN_CHUNK", 64),
                            ("TAIL_STEP", 128)):
            monkeypatch.setattr(plan, name, value)
        shapes = [(900, 1), (5, 1), (700, 300), (40, 30), (2048, 1024), (513, 64), (640, 128), (0, 200), (0, 256)]
        long, first_min = [300, 1024, 64, 128, 200, 256], 64
    else:
        shapes = [(3000, 1), (0, 1), (16384, 1024), (20000, 1500), (9000, 1100), (11264, 1024), (0, 4096)]
        long, first_min = [1024, 1500, 1100, 1024, 4096], 2048
    batch = make_batch(shapes, 2, H=32, Hkv=8, D=128, block_size=16, dtype=dtype, device="cuda", seed=2,
                       in_runs=True)
    kc, vc = _written(batch)
    m = batch.meta
    tables = [row[: -(-n // 16)] for row, n in zip(m.block_tables.tolist(), m.seq_lens_cpu)]
    m.page_runs = plan.page_runs(tables, m.query_lens_cpu, m.seq_lens_cpu, 2, 16)
    assert sorted(m.page_runs) == [i for i, (_, n) in enumerate(shapes) if n >= plan.MIN_CHUNK]
    ref = reference.paged_attention(batch.query, kc, vc, m, scale=128 ** -0.5)
    _poison_dead_slots(kc, vc, m)
    outs = []
    for in_place in (True, False):
        g = gp.GatheredPrefill(max(m.seq_lens_cpu) + 1, 8, 128, dtype, torch.device("cuda"), merge_into=merge_into,
                               fold_into=fold_into, first_chunk_tokens=first_min, square_gqa=True, tail_on_cudnn=True,
                               pages_in_place=in_place)
        g.first_q_row_strides.add(batch.query.stride(0))
        g.k.fill_(float("nan")), g.v.fill_(float("nan"))
        monkeypatch.setitem(gp._ACTIVE, kc.device, g)
        used = []
        attend = g.attend
        monkeypatch.setattr(g, "attend", lambda q, *a, **kw: used.append(q.shape[0]) or attend(q, *a, **kw))
        outs.append(ops.paged_attention(batch.query, kc, vc, m, scale=128 ** -0.5))
        assert used == long
        torch.testing.assert_close(outs[-1].float(), ref.float(), **TOL[dtype])
        if in_place:
            assert g.k[plan.bucket(max(long), plan.QUERY_BUCKET):].isnan().all()
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-2, atol=1e-3)


@pytest.mark.parametrize("merge,first", [("torch", False), ("triton", False), ("torch", True), ("triton", True)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("buckets", ["small", "serving"])
@pytest.mark.parametrize("square_gqa,tail", [(True, True), (True, False), (False, False)])
def test_gathered_prefill_cudnn(ops, monkeypatch, dtype, buckets, merge, first, square_gqa, tail):
    """PAGEDSERVE_LONG_PREFILL=cudnn's path with cuDNN's and flash's real ops, routed through
    paged_attention beside decodes and a short chunk; slots past each sequence's end are NaN.
    small: buckets shrunk so that several long chunks fit a small test; serving: the defaults.
    merge: the parts merged (and the queries folded) by torch ops or by triton_merge's (and
    triton_fold's) kernel (PAGEDSERVE_LONG_PREFILL_MERGE, PAGEDSERVE_LONG_PREFILL_FOLD);
    first: PAGEDSERVE_LONG_PREFILL_FIRST on, with a first chunk and one after a short prefix;
    square_gqa: the square's K/V handed to cuDNN as 8 KV heads for 32 query heads, or repeated;
    tail: prefix tails of whole TAIL_STEPs on cuDNN (PAGEDSERVE_LONG_PREFILL_TAIL), (640, 128) and
    (11264, 1024) have one; first chunks filling their bucket, (0, 256) and (0, 4096), read their
    queries in place."""
    from pagedserve.attention import gathered_prefill as gp, gathered_prefill_plan as plan
    from pagedserve.attention.triton_fold import fold_into
    from pagedserve.attention.triton_merge import merge_into
    if buckets == "small":
        for name, value in (("PREFIX_BUCKET", 256), ("QUERY_BUCKET", 128), ("MIN_PREFIX", 512), ("MIN_CHUNK", 64),
                            ("TAIL_STEP", 128)):
            monkeypatch.setattr(plan, name, value)
        shapes = [(900, 1), (5, 1), (700, 300), (40, 30), (2048, 1024), (513, 64), (640, 128)]
        long = [300, 1024, 64, 128]
        first_min, firsts = 64, [(0, 200), (100, 150), (0, 256)]
    else:
        # (9000, 1100): after one prefix bucket (MIN_PREFIX = PREFIX_BUCKET since the 36th session)
        shapes = [(3000, 1), (0, 1), (16384, 1024), (20000, 1500), (9000, 1100), (11264, 1024)]
        long = [1024, 1500, 1100, 1024]
        first_min, firsts = 2048, [(0, 4096), (500, 2048)]
    if first:
        shapes, long = shapes + firsts, long + [n for _, n in firsts]
    batch = make_batch(shapes, 2, H=32, Hkv=8, D=128, block_size=16, dtype=dtype, device="cuda", seed=2)
    kc, vc = _written(batch)
    m = batch.meta
    ref = reference.paged_attention(batch.query, kc, vc, m, scale=128 ** -0.5)
    _poison_dead_slots(kc, vc, m)
    g = gp.GatheredPrefill(max(m.seq_lens_cpu) + 1, 8, 128, dtype, torch.device("cuda"),
                           merge_into=merge_into if merge == "triton" else None,
                           fold_into=fold_into if merge == "triton" else None,
                           first_chunk_tokens=first_min if first else 0, square_gqa=square_gqa, tail_on_cudnn=tail)
    g.first_q_row_strides.add(batch.query.stride(0))
    monkeypatch.setitem(gp._ACTIVE, kc.device, g)
    used = []
    attend = g.attend
    monkeypatch.setattr(g, "attend", lambda q, *a, **kw: used.append(q.shape[0]) or attend(q, *a, **kw))
    out = ops.paged_attention(batch.query, kc, vc, m, scale=128 ** -0.5)
    assert used == long
    torch.testing.assert_close(out.float(), ref.float(), **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("buckets", ["small", "serving"])
@pytest.mark.parametrize("in_runs", [True, False])
def test_gathered_prefill_prefix_gqa(ops, monkeypatch, dtype, buckets, in_runs):
    """PAGEDSERVE_LONG_PREFILL_PREFIX=gqa with cuDNN's real ops: the queries are rows of a qkv
    (32 query heads, 8 KV heads: 48 heads wide) and reach every cuDNN part unfolded at that row
    stride, as the warm-up builds its plans (here built by warm_up_plans itself), cuDNN serving the
    KV groups; chunks filling their bucket read their queries in place, the others ((700, 300),
    (20000, 1500), ...) a padded copy; whole-step tails on cuDNN, the rest on flash (folded). Pages
    in one run (read in place) or scattered (gathered). Equal to the reference through
    paged_attention, beside decodes whose queries are rows of the same qkv."""
    from pagedserve.attention import gathered_prefill as gp, gathered_prefill_plan as plan
    from pagedserve.attention.triton_fold import fold_into
    from pagedserve.attention.triton_merge import merge_into
    if buckets == "small":
        for name, value in (("PREFIX_BUCKET", 256), ("QUERY_BUCKET", 128), ("MIN_PREFIX", 512), ("MIN_CHUNK", 64),
                            ("TAIL_STEP", 128)):
            monkeypatch.setattr(plan, name, value)
        shapes = [(900, 1), (5, 1), (700, 300), (40, 30), (2048, 1024), (513, 64), (640, 128), (0, 256), (0, 200)]
        long, first_min, max_tokens = [300, 1024, 64, 128, 256, 200], 64, 1024
    else:
        shapes = [(3000, 1), (0, 1), (16384, 1024), (20000, 1500), (9000, 1100), (11264, 1024), (0, 4096)]
        long, first_min, max_tokens = [1024, 1500, 1100, 1024, 4096], 2048, 4096
    H, Hkv, D = 32, 8, 128
    batch = make_batch(shapes, 2, H=H, Hkv=Hkv, D=D, block_size=16, dtype=dtype, device="cuda", seed=2,
                       in_runs=in_runs)
    kc, vc = _written(batch)
    m = batch.meta
    if in_runs:
        tables = [row[: -(-n // 16)] for row, n in zip(m.block_tables.tolist(), m.seq_lens_cpu)]
        m.page_runs = plan.page_runs(tables, m.query_lens_cpu, m.seq_lens_cpu, 2, 16)
    ref = reference.paged_attention(batch.query, kc, vc, m, scale=D ** -0.5)
    _poison_dead_slots(kc, vc, m)
    width = (H + 2 * Hkv) * D
    qkv = torch.full((batch.query.shape[0], width), float("nan"), dtype=dtype, device="cuda")
    query = qkv[:, :H * D].view(-1, H, D)
    query.copy_(batch.query)
    g = gp.GatheredPrefill(max(m.seq_lens_cpu) + 1, Hkv, D, dtype, torch.device("cuda"), merge_into=merge_into,
                           fold_into=fold_into, first_chunk_tokens=first_min, square_gqa=True, tail_on_cudnn=True,
                           pages_in_place=in_runs, prefix_gqa=True)
    gp.warm_up_plans(g, max_tokens, H, D ** -0.5, q_row_stride=width)
    assert g.gqa_q_row_stride == width
    g.k.fill_(float("nan")), g.v.fill_(float("nan"))
    monkeypatch.setitem(gp._ACTIVE, kc.device, g)
    used = []
    attend = g.attend
    monkeypatch.setattr(g, "attend", lambda q, *a, **kw: used.append(q.shape[0]) or attend(q, *a, **kw))
    out = ops.paged_attention(query, kc, vc, m, scale=D ** -0.5)
    assert used == long
    torch.testing.assert_close(out.float(), ref.float(), **TOL[dtype])
