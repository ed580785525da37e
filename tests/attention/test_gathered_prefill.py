"""gathered_prefill.py (PAGEDSERVE_LONG_PREFILL=cudnn): a long chunk's attention over its gathered,
padded context equals reference.py's over the pages. On CPU the cuDNN and flash ops are stood in
for by plain softmax attention with the same signatures (bias, scale, log-sum-exp); the CUDA ops
themselves are checked in tests/attention/test_triton_gpu.py and timed by prefill_sweep.py."""
import dataclasses

import pytest
import torch

from pagedserve.attention import gathered_prefill as gp, reference
from pagedserve.attention import gathered_prefill_plan as plan, gathered_prefill_switches as switches
from paged_batch import make_batch


def math_flash(q, k, v, causal, scale):
    """With fewer K/V heads than query heads, grouped-query attention as cuDNN's is: query head h
    reads KV head h // (H / Hkv)."""
    k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], dim=1) for t in (k, v))
    scores = (q.float() @ k.float().transpose(-1, -2)) * scale
    if causal:
        scores = scores.masked_fill(torch.ones_like(scores, dtype=torch.bool).triu(1), float("-inf"))
    return (scores.softmax(-1) @ v.float()).to(q.dtype), scores.logsumexp(-1)


def math_prefix(q, k, v, scale):
    return math_flash(q, k, v, False, scale)


def math_causal(q, k, v, scale):
    return math_flash(q, k, v, True, scale)


@pytest.fixture
def small_buckets(monkeypatch):
    monkeypatch.setattr(plan, "PREFIX_BUCKET", 32)
    monkeypatch.setattr(plan, "QUERY_BUCKET", 8)
    monkeypatch.setattr(plan, "TAIL_STEP", 8)
    monkeypatch.setattr(plan, "MIN_PREFIX", 40)
    monkeypatch.setattr(plan, "MIN_CHUNK", 4)


@pytest.fixture(params=[40, 32], ids=["min_prefix_past_bucket", "min_prefix_one_bucket"])
def small_buckets_any_min(request, small_buckets, monkeypatch):
    """small_buckets, with MIN_PREFIX past the prefix bucket (40) or at it (32, as the defaults are
    since the 36th session: a chunk after exactly one bucket takes the path)."""
    monkeypatch.setattr(plan, "MIN_PREFIX", request.param)


@pytest.mark.parametrize("square_gqa,tail_on_cudnn", [(True, True), (True, False), (False, False)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("cached,new,block_size", [(40, 4, 16), (77, 13, 8), (96, 32, 16), (100, 9, 1),
                                                   (0, 20, 8), (13, 12, 16), (56, 8, 8), (16, 12, 8)])
def test_long_chunk_equals_reference(small_buckets, dtype, cached, new, block_size, square_gqa, tail_on_cudnn):
    """Prefixes off and on the bucket edge (96 = 3 x 32: no tail past the bucketed head), chunks
    off and on the query bucket, pages of 1/8/16 tokens; the pool's spare slots are random
    (garbage past the sequence). First chunks (PAGEDSERVE_LONG_PREFILL_FIRST): none before (the
    square alone), or fewer than a prefix bucket (no cuDNN prefix part but a whole-step one).
    square_gqa: the square's K/V as the 2 KV heads (PAGEDSERVE_LONG_PREFILL_SQUARE=gqa) or repeated
    to the 6 query heads. tail_on_cudnn (PAGEDSERVE_LONG_PREFILL_TAIL): a tail of whole 8-token
    steps past the head (40 - 32, 56 - 32, 16) goes to cuDNN's prefix op, any other to flash."""
    batch = make_batch([(3, 1), (cached, new)], 1, H=6, Hkv=2, D=16, block_size=block_size, dtype=dtype)
    kc, vc = batch.k_cache.clone(), batch.v_cache.clone()
    reference.write_kv(batch.new_k, batch.new_v, kc, vc, batch.meta.slot_mapping)
    scale = 16 ** -0.5
    ref = reference.paged_attention(batch.query, kc, vc, batch.meta, scale)[1:]
    heads, squares, flashes = [], [], []
    g = gp.GatheredPrefill(160, 2, 16, dtype, torch.device("cpu"),
                           lambda q, k, *a: heads.append((q.shape[2], k.shape[2])) or math_prefix(q, k, *a),
                           lambda q, k, *a: flashes.append(k.shape[2]) or math_flash(q, k, *a),
                           lambda q, k, *a: squares.append((q.shape[1:3], k.shape[1:3])) or math_causal(q, k, *a),
                           square_gqa=square_gqa, tail_on_cudnn=tail_on_cudnn)
    g.k.fill_(float("nan")), g.v.fill_(float("nan"))  # stale NaNs past the sequence must not reach the output
    got = g.attend(batch.query[1:], kc, vc, batch.meta.block_tables[1], cached + new, scale)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(got, ref, **tol)
    # cuDNN only ever sees bucketed shapes: queries (folded, 3 heads a group) and the prefix's head;
    # the square, 6 query heads over 2 KV heads (or 6 repeated), padded to the query bucket
    rows, head, tail = plan.bucket(new, 8), cached // 32 * 32, cached % 32
    on_cudnn = tail_on_cudnn and tail % 8 == 0
    assert heads == [(3 * rows, n) for n in (head, tail if on_cudnn else 0) if n]
    assert flashes == ([tail] if tail and not on_cudnn else [])
    assert squares == [((6, rows), (2 if square_gqa else 6, rows))]


@pytest.mark.parametrize("tail_on_cudnn", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("cached,new,block_size", [(40, 4, 16), (77, 13, 8), (96, 32, 16), (100, 9, 1),
                                                   (0, 20, 8), (13, 12, 16), (56, 8, 8), (64, 16, 8)])
def test_prefix_gqa_hands_cudnn_the_queries_unfolded(small_buckets, dtype, cached, new, block_size, tail_on_cudnn):
    """PAGEDSERVE_LONG_PREFILL_PREFIX=gqa: the queries reach every cuDNN part as [1, 6, rows, D]
    at the row stride the warm-up built the plans at (a qkv 10 heads wide): in place where they are
    rows of such a qkv and fill their 8-row bucket (32 and 16 and 8 new tokens); else (padded, or
    contiguous queries, 6 heads wide) a copy at those strides padded with zero rows. Folded only for
    a tail on flash (a tail that is not whole 8-token steps, or any with tail_on_cudnn off). With no
    such plans (a warm-up without the qkv's stride) the folded path. Equal to the reference always."""
    H, Hkv, D = 6, 2, 16
    batch = make_batch([(3, 1), (cached, new)], 1, H=H, Hkv=Hkv, D=D, block_size=block_size, dtype=dtype)
    kc, vc = batch.k_cache.clone(), batch.v_cache.clone()
    reference.write_kv(batch.new_k, batch.new_v, kc, vc, batch.meta.slot_mapping)
    scale = D ** -0.5
    ref = reference.paged_attention(batch.query, kc, vc, batch.meta, scale)[1:]
    width = (H + 2 * Hkv) * D
    qkv = torch.randn(new, width).to(dtype)
    q = qkv[:, :H * D].view(new, H, D)
    q.copy_(batch.query[1:])
    rows, head, tail = plan.bucket(new, 8), cached // 32 * 32, cached % 32
    on_cudnn = tail_on_cudnn and tail % 8 == 0
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    for queries, registered in ((q, True), (q.contiguous(), True), (q, False)):
        seen, folds = {"prefix": [], "square": []}, []

        def recorder(kind, fn):
            return lambda q, k, *a: seen[kind].append((tuple(q.shape), q.stride()[1:], q.data_ptr())) or fn(q, k, *a)

        def fold_into(q, out):
            folds.append(q.shape[0])
            out[:, :q.shape[0]] = q.permute(1, 0, 2)
            out[:, q.shape[0]:] = 0
            return out
        g = gp.GatheredPrefill(160, Hkv, D, dtype, torch.device("cpu"), recorder("prefix", math_prefix), math_flash,
                               recorder("square", math_causal), fold_into=fold_into, square_gqa=True,
                               tail_on_cudnn=tail_on_cudnn, prefix_gqa=True)
        if registered:
            g.gqa_q_row_stride = width
        g.k.fill_(float("nan")), g.v.fill_(float("nan"))
        got = g.attend(queries, kc, vc, batch.meta.block_tables[1], cached + new, scale)
        torch.testing.assert_close(got, ref, **tol)
        n_prefix = len([n for n in (head, tail if on_cudnn else 0) if n])
        if registered:
            unfolded = ((1, H, rows, D), (D, width, 1))
            assert [call[:2] for call in seen["prefix"]] == [unfolded] * n_prefix
            assert [call[:2] for call in seen["square"]] == [unfolded]
            in_place = new == rows and queries is q  # the qkv's own rows, not a padded copy
            assert all((ptr == queries.data_ptr()) is in_place for *_, ptr in seen["prefix"] + seen["square"])
            assert folds == ([new] if tail and not on_cudnn else [])
        else:
            assert [call[0] for call in seen["prefix"]] == [(1, Hkv, 3 * rows, D)] * n_prefix
            assert folds == [new]


def in_one_run(batch, seq: int, first: int, spare: int = 2):
    """The batch's pools with sequence seq's pages moved to one run of ascending ids from `first`
    (random garbage everywhere else, as a pool's other blocks hold), and that run's table."""
    table = batch.meta.block_tables[seq][: -(-batch.meta.seq_lens_cpu[seq] // batch.meta.block_size)].long()
    run = torch.arange(first, first + len(table))
    pools = []
    for pool in (batch.k_cache, batch.v_cache):
        moved = torch.randn(first + len(table) + spare, *pool.shape[1:]).to(pool.dtype)
        moved[run] = pool[table]
        pools.append(moved)
    return (*pools, run.to(torch.int32))


@pytest.mark.parametrize("square_gqa", [True, False])
@pytest.mark.parametrize("cached,new,block_size", [(40, 8, 16), (77, 13, 8), (96, 32, 16), (100, 9, 1),
                                                   (0, 16, 8), (0, 20, 8), (16, 12, 8), (56, 8, 8)])
def test_pages_in_one_run_are_read_in_place(small_buckets, cached, new, block_size, square_gqa):
    """A chunk whose pages lie in one run of the pool (first_page, the runner's page_runs) reads
    them where they are: its attention equals the reference's, and nothing is gathered (the
    buffers keep their NaNs, but for a padded square's own keys, copied to their start: 20 and 13
    and 12 and 9 new tokens pad to 24 / 16 / 16 / 16). With GATHER_ENV's 'always' (pages_in_place
    False) the same chunk is gathered, to the same result."""
    dtype = torch.float32
    batch = make_batch([(3, 1), (cached, new)], 1, H=6, Hkv=2, D=16, block_size=block_size, dtype=dtype)
    kc, vc = batch.k_cache.clone(), batch.v_cache.clone()
    reference.write_kv(batch.new_k, batch.new_v, kc, vc, batch.meta.slot_mapping)
    scale = 16 ** -0.5
    ref = reference.paged_attention(batch.query, kc, vc, batch.meta, scale)[1:]
    moved = dataclasses.replace(batch, k_cache=kc, v_cache=vc)
    k_run, v_run, run = in_one_run(moved, 1, first=5)
    rows = plan.bucket(new, 8)
    for in_place in (True, False):
        g = gp.GatheredPrefill(160, 2, 16, dtype, torch.device("cpu"), math_prefix, math_flash, math_causal,
                               square_gqa=square_gqa, tail_on_cudnn=True, pages_in_place=in_place)
        g.k.fill_(float("nan")), g.v.fill_(float("nan"))
        got = g.attend(batch.query[1:], k_run, v_run, run, cached + new, scale, first_page=5)
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
        written = (~g.k.isnan().all(-1).all(-1)).nonzero().flatten().tolist()
        assert (g.chunks_in_place, g.chunks_gathered) == ((1, 0) if in_place else (0, 1))
        if in_place:
            assert written == (list(range(rows)) if rows > new else [])
        else:
            assert written[:cached + new] == list(range(cached + new))


def test_a_pool_not_laid_end_to_end_is_gathered(small_buckets):
    """A run of pages in a pool whose blocks are not contiguous in memory (K and V interleaved by
    block) is gathered, not read through a flattened copy, and equals the reference."""
    batch = make_batch([(3, 1), (40, 8)], 1, H=6, Hkv=2, D=16, block_size=8)
    kc, vc = batch.k_cache.clone(), batch.v_cache.clone()
    reference.write_kv(batch.new_k, batch.new_v, kc, vc, batch.meta.slot_mapping)
    ref = reference.paged_attention(batch.query, kc, vc, batch.meta, 0.25)[1:]
    k_run, v_run, run = in_one_run(dataclasses.replace(batch, k_cache=kc, v_cache=vc), 1, first=2)
    both = torch.stack([k_run, v_run], dim=1)  # [blocks, 2, bs, Hkv, D]: each pool strided
    g = gp.GatheredPrefill(160, 2, 16, torch.float32, torch.device("cpu"), math_prefix, math_flash, math_causal,
                           square_gqa=True, tail_on_cudnn=True, pages_in_place=True)
    got = g.attend(batch.query[1:], both[:, 0], both[:, 1], run, 48, 0.25, first_page=2)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    assert (g.chunks_in_place, g.chunks_gathered) == (0, 1)


def test_page_run_start():
    assert plan.page_run_start([7, 8, 9, 10, 3], 4) == 7 == plan.page_run_start([7, 8, 9, 10], 4)
    assert plan.page_run_start([7, 8, 9, 10], 1) == 7
    assert plan.page_run_start([7, 9, 8, 10], 4) is None  # first and last in place, the middle not
    assert plan.page_run_start([10, 9, 8, 7], 4) is None  # descending
    assert plan.page_run_start([7, 8, 9], 4) is None  # too short
    assert plan.page_run_start([7, 8], 0) is None


def test_page_runs_names_long_chunks_in_one_run(small_buckets):
    """Only prefill sequences with chunks of MIN_CHUNK tokens or more are looked at, over the
    pages through their chunk (later pages may lie anywhere)."""
    tables = [[50], [3, 4, 5, 6], [20, 21, 30], [8, 9, 10, 11, 40], [60, 61]]
    query_lens = [1, 4, 8, 9, 3]
    seq_lens = [5, 30, 20, 32, 16]
    assert plan.page_runs(tables, query_lens, seq_lens, 1, 8) == {1: 3, 3: 8}
    assert plan.page_runs(tables[:3], query_lens[:3], seq_lens[:3], 2, 8) is None


@pytest.mark.parametrize("registered", [True, False])
@pytest.mark.parametrize("new", [16, 12])
def test_first_chunk_square_reads_the_queries_in_place(small_buckets, new, registered):
    """A first chunk filling its query bucket (16 = 2 x 8) whose queries are rows of a wider qkv at
    a row stride the warm-up built plans for: the square reads them where they are (a strided
    view, no fold copy), and equals the reference; 12 tokens (padded) or an unregistered stride:
    the folded copy."""
    H, Hkv, D = 6, 2, 16
    batch = make_batch([(0, new)], 0, H=H, Hkv=Hkv, D=D, block_size=8)
    kc, vc = batch.k_cache.clone(), batch.v_cache.clone()
    reference.write_kv(batch.new_k, batch.new_v, kc, vc, batch.meta.slot_mapping)
    ref = reference.paged_attention(batch.query, kc, vc, batch.meta, D ** -0.5)
    qkv = torch.randn(new, (H + 2 * Hkv) * D)
    q = qkv[:, :H * D].view(new, H, D)
    q.copy_(batch.query)
    seen = []
    g = gp.GatheredPrefill(160, Hkv, D, torch.float32, torch.device("cpu"), math_prefix, math_flash,
                           lambda q, *a: seen.append(q.is_contiguous()) or math_causal(q, *a), square_gqa=True,
                           first_chunk_tokens=8)
    if registered:
        g.first_q_row_strides.add(qkv.stride(0))
    out = torch.full_like(batch.query, float("nan"))
    got = g.attend(q, kc, vc, batch.meta.block_tables[0], new, D ** -0.5, out=out)
    assert got is out
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    assert seen == [not (registered and new == 16)]


def test_which_chunks_take_the_path(small_buckets):
    batch = make_batch([(3, 1), (50, 2), (39, 8), (40, 4), (0, 60), (45, 5)], 1, H=2, Hkv=1, D=8, block_size=8)
    assert plan.long_chunks(batch.meta, batch.k_cache) == [3, 5]  # >= 4 new tokens after >= 40
    # PAGEDSERVE_LONG_PREFILL_FIRST=N: also >= N new tokens after < 32 (the prefix bucket)
    assert plan.long_chunks(batch.meta, batch.k_cache, first_chunk=20) == [3, 4, 5]
    assert plan.long_chunks(batch.meta, batch.k_cache, first_chunk=61) == [3, 5]
    assert plan.takes(20, 51, 20) and not plan.takes(20, 52, 20)  # 31 before: flash; 32: a prefix plan not built
    assert plan.long_chunks(batch.meta, batch.k_cache.to(torch.float8_e4m3fn)) == []
    assert plan.other_ranges(1, 6, [3, 5]) == [(1, 2), (4, 1)]
    assert plan.other_ranges(1, 6, []) == [(1, 5)]


def test_only_the_pool_layout_and_heads_it_was_built_for_take_the_path(small_buckets):
    """GatheredPrefill.chunks (what paged_attention routes by): another model's attention on the
    device (a draft model's pool: other KV heads, head size or dtype; or other query heads than
    the warmed plans') keeps its chunks on the Triton kernels."""
    shapes = [(3, 1), (50, 2), (39, 8), (40, 4), (0, 60), (45, 5)]
    g = gp.GatheredPrefill(128, 2, 8, torch.float32, torch.device("cpu"), math_prefix, math_flash, math_causal,
                           first_chunk_tokens=20)

    def chunks(H=4, Hkv=2, D=8, dtype=torch.float32):
        batch = make_batch(shapes, 1, H=H, Hkv=Hkv, D=D, block_size=8)
        return g.chunks(batch.meta, batch.query, batch.k_cache.to(dtype))
    assert chunks() == [3, 4, 5] == chunks(H=6)  # before the warm-up: any query heads
    assert chunks(Hkv=1) == chunks(D=16) == chunks(dtype=torch.float16) == []
    gp.warm_up_plans(g, max_tokens=24, num_heads=4, scale=0.5)  # plans for 4 query heads
    assert chunks() == [3, 4, 5] and chunks(H=6) == []


def test_plan_shapes_cover_every_chunk(small_buckets_any_min):
    """Every (chunk, context) the path takes lands on a shape warm_up_plans builds."""
    for tail_on_cudnn in (False, True):
        g = gp.GatheredPrefill(200, 1, 8, torch.float32, torch.device("cpu"), tail_on_cudnn=tail_on_cudnn)
        shapes = set(g.shapes(max_tokens=24))
        for seq_len in range(1, 201):
            for new in range(1, min(24, seq_len) + 1):
                for first in (0, 5):
                    if plan.takes(new, seq_len, first):
                        head = (seq_len - new) // plan.PREFIX_BUCKET * plan.PREFIX_BUCKET
                        tail = seq_len - new - head
                        rows = plan.bucket(new, plan.QUERY_BUCKET)
                        assert rows in plan.query_rows(24)  # its square's plan
                        assert head == 0 or (rows, head) in shapes
                        # a whole-step tail on cuDNN, at a built shape
                        assert not (tail_on_cudnn and tail and tail % plan.TAIL_STEP == 0) or (rows, tail) in shapes


@pytest.mark.parametrize("square_gqa,tail_on_cudnn,prefix_gqa", [(True, True, False), (True, False, False),
                                                                  (False, True, False), (True, True, True),
                                                                  (False, False, True)])
def test_warm_up_builds_every_plan_a_chunk_meets(small_buckets_any_min, square_gqa, tail_on_cudnn, prefix_gqa):
    """cuDNN keys its plans by shapes and strides: the warm-up calls it with both as attend does, for
    every chunk a step of up to max_tokens tokens can bring (nothing is built after start-up):
    whole-step tails under tail_on_cudnn, and first chunks filling their bucket, their queries
    views of a qkv rows 10 * 8 wide (6 query heads, 2 KV heads). prefix_gqa: every part's queries
    at that stride, unfolded (the first chunks' squares among the squares' plans)."""
    seen = {"prefix": set(), "square": set()}
    key = lambda *ts: tuple((tuple(t.shape), t.stride()) for t in ts)  # noqa: E731

    def recorder(kind, fn):
        return lambda q, k, v, *a: seen[kind].add(key(q, k, v)) or fn(q, k, v, *a)
    g = gp.GatheredPrefill(200, 2, 8, torch.float32, torch.device("cpu"), recorder("prefix", math_prefix),
                           math_flash, recorder("square", math_causal), square_gqa=square_gqa,
                           tail_on_cudnn=tail_on_cudnn, first_chunk_tokens=16, prefix_gqa=prefix_gqa)
    n = gp.warm_up_plans(g, max_tokens=24, num_heads=6, scale=0.3, q_row_stride=80)
    built = {kind: set(keys) for kind, keys in seen.items()}
    # squares: 8, 16 and 24 rows; first chunks in place: 16 and 24 (under prefix_gqa, the squares')
    assert n == len(built["prefix"]) + len(built["square"]) == len(g.shapes(24)) + 3 + (0 if prefix_gqa else 2)
    assert g.first_q_row_strides == {80}
    assert g.gqa_q_row_stride == (80 if prefix_gqa else None)
    for kind in seen:
        seen[kind].clear()
    kc = torch.randn(30, 8, 2, 8)  # 30 pages of 8 tokens
    table = torch.randperm(30)
    tails = set()
    g.pages_in_place = True
    for seq_len in [*range(16, 25), *range(41, 201, 7), 48, 64, 120, 200]:
        for new in (4, 8, 11, 16, 24):
            if new <= seq_len and plan.takes(new, seq_len, g.first_chunk_tokens):
                q = torch.randn(new, 80)[:, :48].view(new, 6, 8)
                g.attend(q, kc, kc, table, seq_len, 0.3)
                g.attend(q, kc, kc, torch.arange(30), seq_len, 0.3, first_page=0)  # read in place
                tails.add((seq_len - new) % plan.PREFIX_BUCKET)
    assert seen["prefix"] and seen["square"] and 8 in tails and 16 in tails and 0 in tails
    assert seen["prefix"] <= built["prefix"] and seen["square"] <= built["square"]


def test_warm_up_runs_the_merge_and_fold_kernels(small_buckets):
    """With the one-pass merge on, the warm-up runs it with 2 and 3 parts (its compiles), in the
    pool's dtype with float32 log-sum-exps as the real ops give them; with the one-pass fold on, it
    runs that once, with queries shorter than the bucket (the padding too); without them, never."""
    calls, folds = [], []

    def merge_into(parts, out):
        calls.append((len(parts), parts[0][0].dtype, parts[0][1].dtype, out.dtype, tuple(out.shape)))
        return out

    def fold_into(q, out):
        folds.append((q.dtype, q.shape[0] < out.shape[1], tuple(out.shape)))
        return out
    for merge, fold, want in ((merge_into, fold_into, [2, 3]), (None, None, [])):
        calls.clear(), folds.clear()
        g = gp.GatheredPrefill(200, 2, 8, torch.bfloat16, torch.device("cpu"), math_prefix, math_flash, math_causal,
                               merge_into=merge, fold_into=fold)
        gp.warm_up_plans(g, max_tokens=24, num_heads=6, scale=0.3)
        assert [n for n, *_ in calls] == want
        assert all(c[1:] == (torch.bfloat16, torch.float32, torch.bfloat16, (plan.QUERY_BUCKET, 6, 8)) for c in calls)
        assert folds == ([(torch.bfloat16, True, (6, plan.QUERY_BUCKET, 8))] if fold else [])


def test_merge_kernel_is_told_its_strides_are_aligned_only_when_they_are(monkeypatch, small_buckets):
    """triton_merge.merge_into hands the kernel its parts' and output's strides in units of 16
    elements (so that it moves 16 bytes an access: test_merge_compile.py) only where every one of
    them is a multiple of 16, and the warm-up meets the same variant as serving's parts (cuDNN's
    [H, rows, D] views of [rows, H, D] memory), so that nothing compiles after start-up. (The
    kernel's arithmetic either way: triton_interpret_cases.test_merge_kernel_matches_the_torch_merge.)"""
    from pagedserve.attention import triton_merge
    seen = []

    class Launch:
        def __getitem__(self, grid):
            return lambda *args, **kw: seen.append((kw["STRIDE_UNIT"], args[8:14] + args[17:19]))
    monkeypatch.setattr(triton_merge, "merge_parts_kernel", Launch())

    def merged(D, rows=24, c=20, H=6, out_pad=0, layout="heads_first"):
        if layout == "heads_first":
            o = torch.zeros(H, rows, D)
        else:  # as SDPA returns it: [H, rows, D] over [rows, H, D] memory
            o = torch.zeros(rows, H, D).transpose(0, 1)
        out = torch.zeros(c + 2, H * D + out_pad)[1:c + 1, :H * D].view(c, H, D)
        triton_merge.merge_into([(o, torch.zeros(H, rows))] * 2, out)
        unit, strides = seen.pop()
        want = [o.stride(0), o.stride(1)] * 3 + [out.stride(0), out.stride(1)]
        assert [s * unit for s in strides] == want  # the kernel's offsets are the tensors'
        return unit
    assert merged(16) == merged(32, layout="rows_first") == merged(128, c=7) == 16
    assert merged(8) == merged(12, layout="rows_first") == 1
    assert merged(16, out_pad=8) == 1  # the output's rows 8 elements off alignment
    g = gp.GatheredPrefill(200, 2, 16, torch.float32, torch.device("cpu"), math_prefix, math_flash, math_causal,
                           merge_into=triton_merge.merge_into)
    gp.warm_up_plans(g, max_tokens=24, num_heads=6, scale=0.3)
    assert [unit for unit, _ in seen] == [16, 16]  # 2 and 3 parts, as serving's at head_dim 16


@pytest.fixture
def gpu_of(monkeypatch):
    """Pretend cuda devices of a given compute capability major (no GPU needed: enabled() only asks
    for the capability; buffers are made on CPU)."""
    def pretend(major):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (major, 0))
        monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
        made = gp.GatheredPrefill
        monkeypatch.setattr(gp, "GatheredPrefill", lambda *a, **kw: made(*a[:4], torch.device("cpu"), **kw))
    return pretend


@pytest.mark.parametrize("value,major,on", [(None, 9, True), ("auto", 9, True), (None, 8, False),
                                            ("cudnn", 8, True), ("cudnn", 9, True), ("off", 9, False),
                                            ("0", 9, False)])
def test_switch_values(monkeypatch, gpu_of, value, major, on):
    """Unset: on for Hopper only (where it was measured); 'cudnn' forces it on any CUDA GPU; never on CPU."""
    gpu_of(major)
    if value is None:
        monkeypatch.delenv(switches.LONG_PREFILL_ENV, raising=False)
    else:
        monkeypatch.setenv(switches.LONG_PREFILL_ENV, value)
    assert switches.enabled(torch.device("cuda", 0)) is on
    assert not switches.enabled(torch.device("cpu"))


def test_bad_switch_value_names_it(monkeypatch, gpu_of):
    """Named at start-up even where the path could not run (a max_model_len no long chunk fits)."""
    gpu_of(9)
    monkeypatch.setenv(switches.LONG_PREFILL_ENV, "flash")
    with pytest.raises(ValueError, match=switches.LONG_PREFILL_ENV):
        switches.enabled(torch.device("cpu"))
    with pytest.raises(ValueError, match=switches.LONG_PREFILL_ENV):
        gp.configure(torch.device("cuda", 0), 4096, 8, 128, torch.bfloat16)


def test_configure_routes_only_where_on(monkeypatch, gpu_of):
    """An engine started with the path off routes no long chunk, even where an earlier engine of
    the same process (same device) had it on; CPU pools, fp8 pools and a max_model_len no long chunk
    fits never take the path; a Hopper GPU takes it by default."""
    cuda0 = torch.device("cuda", 0)
    gpu_of(9)
    monkeypatch.setitem(gp._ACTIVE, cuda0, "an earlier engine's")
    monkeypatch.setenv(switches.LONG_PREFILL_ENV, "off")
    assert gp.configure(cuda0, 32768, 8, 128, torch.bfloat16) is None and gp.active(cuda0) is None
    monkeypatch.delenv(switches.LONG_PREFILL_ENV)
    assert gp.configure(torch.device("cpu"), 32768, 8, 128, torch.bfloat16) is None
    assert gp.configure(cuda0, 32768, 8, 128, torch.float8_e4m3fn) is None  # fp8 pools: the Triton kernels
    # No chunk fits: under the default first chunk, or, with first chunks off, under a long chunk
    # after MIN_PREFIX.
    assert gp.configure(cuda0, switches.FIRST_CHUNK_DEFAULT - 1, 8, 128, torch.bfloat16) is None
    assert gp.active(cuda0) is None
    monkeypatch.setenv(switches.FIRST_CHUNK_ENV, "0")
    too_short = plan.MIN_PREFIX + plan.MIN_CHUNK - 1
    assert gp.configure(cuda0, too_short, 8, 128, torch.bfloat16) is None and gp.active(cuda0) is None
    monkeypatch.delenv(switches.FIRST_CHUNK_ENV)
    g = gp.configure(cuda0, 32768, 8, 128, torch.bfloat16)
    assert g is not None and gp.active(cuda0) is g and tuple(g.k.shape[1:]) == (8, 128) and len(g.k) >= 32768
    gpu_of(8)
    assert gp.configure(cuda0, 32768, 8, 128, torch.bfloat16) is None and gp.active(cuda0) is None


def _merge_into():
    from pagedserve.attention.triton_merge import merge_into
    return merge_into


def _fold_into():
    from pagedserve.attention.triton_fold import fold_into
    return fold_into


@pytest.mark.parametrize("env,attr,cases,bad", [
    # PAGEDSERVE_LONG_PREFILL_MERGE: unset or 'triton', the one-pass kernel; 'torch', the torch merge
    # (the kernel is checked against it under the interpreter, triton_interpret_cases.py)
    (switches.MERGE_ENV, "merge_into", ((None, _merge_into), ("torch", lambda: None), ("triton", _merge_into)),
     "fused"),
    # PAGEDSERVE_LONG_PREFILL_FOLD: unset or 'triton', the one-pass fold; 'torch', a permuted copy
    (switches.FOLD_ENV, "fold_into", ((None, _fold_into), ("torch", lambda: None), ("triton", _fold_into)), "copy"),
    # PAGEDSERVE_LONG_PREFILL_SQUARE: unset or 'gqa', the square's K/V go to cuDNN as the KV heads;
    # 'repeat', repeated to the query heads
    (switches.SQUARE_ENV, "square_gqa", ((None, lambda: True), ("gqa", lambda: True), ("repeat", lambda: False)),
     "flash"),
    # PAGEDSERVE_LONG_PREFILL_TAIL: unset or 'cudnn', whole-step prefix tails to cuDNN; 'flash', to flash
    (switches.TAIL_ENV, "tail_on_cudnn", ((None, lambda: True), ("cudnn", lambda: True), ("flash", lambda: False)),
     "off"),
    # PAGEDSERVE_LONG_PREFILL_GATHER: unset or 'runs', pages in one run read in place; 'always', gathered
    (switches.GATHER_ENV, "pages_in_place", ((None, lambda: True), ("runs", lambda: True), ("always", lambda: False)),
     "never"),
    # PAGEDSERVE_LONG_PREFILL_PREFIX: unset or 'gqa', the prefix parts' queries unfolded; 'folded', folded
    (switches.PREFIX_ENV, "prefix_gqa", ((None, lambda: True), ("gqa", lambda: True), ("folded", lambda: False)),
     "fold"),
], ids=["merge", "fold", "square", "tail", "gather", "prefix"])
def test_switch_choices(monkeypatch, gpu_of, env, attr, cases, bad):
    """Each value of a two-way switch picks its way at start-up (configure); anything else is an
    error naming the switch."""
    cuda0 = torch.device("cuda", 0)
    gpu_of(9)
    for value, want in cases:
        if value is None:
            monkeypatch.delenv(env, raising=False)
        else:
            monkeypatch.setenv(env, value)
        assert getattr(gp.configure(cuda0, 32768, 8, 128, torch.bfloat16), attr) is want()
    monkeypatch.setenv(env, bad)
    with pytest.raises(ValueError, match=env):
        gp.configure(cuda0, 32768, 8, 128, torch.bfloat16)


def test_first_chunk_switch(monkeypatch, gpu_of):
    """PAGEDSERVE_LONG_PREFILL_FIRST=N: unset, FIRST_CHUNK_DEFAULT; 0, off; N, first chunks of N+
    tokens take the path, and a max_model_len too short for a long chunk after MIN_PREFIX gets the
    path where N fits; anything
    but 0 or a whole number >= MIN_CHUNK is an error naming the switch and the limit."""
    cuda0 = torch.device("cuda", 0)
    gpu_of(9)
    monkeypatch.delenv(switches.FIRST_CHUNK_ENV, raising=False)
    assert gp.configure(cuda0, 8192, 8, 128, torch.bfloat16).first_chunk_tokens == switches.FIRST_CHUNK_DEFAULT == 4096
    monkeypatch.setenv(switches.FIRST_CHUNK_ENV, "0")
    assert gp.configure(cuda0, 8192, 8, 128, torch.bfloat16) is None
    assert gp.configure(cuda0, 32768, 8, 128, torch.bfloat16).first_chunk_tokens == 0
    monkeypatch.setenv(switches.FIRST_CHUNK_ENV, "4096")
    assert gp.configure(cuda0, 8192, 8, 128, torch.bfloat16).first_chunk_tokens == 4096
    assert gp.configure(cuda0, 4095, 8, 128, torch.bfloat16) is None
    for bad in ("4k", "512"):  # not a number; under MIN_CHUNK (1024), padded to a whole query bucket
        monkeypatch.setenv(switches.FIRST_CHUNK_ENV, bad)
        with pytest.raises(ValueError, match=f"{switches.FIRST_CHUNK_ENV}.*>= 1024"):
            gp.configure(cuda0, 32768, 8, 128, torch.bfloat16)
