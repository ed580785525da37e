"""Long prefill chunks through cuDNN's attention over their gathered context (on by default on Hopper;
PAGEDSERVE_LONG_PREFILL: enabled()).

At long contexts nearly all of a prefill's time is its attention, and there our Triton prefill
kernel runs at ~0.75x the speed of cuDNN's fused attention over contiguous K/V (416-451 against
558-647 TFLOPS on the H200, benchmarks/kernels/prefill_sweep.py --split-baselines). cuDNN does not
read a block table, so a long chunk takes this path instead:

A chunk of c new tokens after P earlier ones attends to the P earlier tokens, unmasked, and to its
own c tokens, causally; at long contexts the first is nearly all of it (P * c against c * c / 2).
The context's K/V are gathered out of their pages by one index_select each into buffers laid out
as the pages lay their rows ([positions, Hkv, D], ~2 KB a token a layer for Llama-3.1-8B: 0.4 GB at
100k); cuDNN and flash read them as strided views, heads first, never copied again. cuDNN builds an
execution plan per shape and stride (70-100 ms each on the H200), and a long prefill meets a new
context length every step, so the prefix is cut at its last multiple of PREFIX_BUCKET:
(1) the first B = (P // PREFIX_BUCKET) * PREFIX_BUCKET tokens go to cuDNN, with each KV group's
    query heads folded into the query length (K/V read once per group, never repeated) and the
    queries padded with zero rows to a multiple of QUERY_BUCKET tokens: serving meets only these
    bucketed shapes, whose plans the warm-up builds (warm_up_plans; none is built after start-up);
(2) the rest of the prefix (< PREFIX_BUCKET tokens), folded likewise: to cuDNN where it is a
    whole number of TAIL_STEP tokens (as it is when chunks end on the engine's chunk alignment:
    one plan per such length and query bucket), else to torch's flash kernel, which builds no
    plans but runs at about half cuDNN's speed (TAIL_ENV);
(3) the chunk's own square, causal, padded to its query bucket (zero keys past the chunk, which a
    real row never sees under the top-left mask) to cuDNN as grouped-query attention (SQUARE_ENV):
    one plan per query bucket.
The parts are merged by their log-sum-exps (the versions before this one, a bias-masked prefix and
a square on flash, are in docs/long-context.md). Chunks shorter than MIN_CHUNK or after fewer than
MIN_PREFIX tokens stay on the Triton kernel, except first chunks of FIRST_CHUNK_DEFAULT+ tokens
(FIRST_CHUNK_ENV): their square alone, on cuDNN's causal kernel, which then reads the queries
where they are (a strided view, as long as the chunk fills its query bucket) instead of a copy.

The parts are merged in one Triton pass straight into the layer's output (triton_merge.merge_into,
whose docstring has its figures), or with PAGEDSERVE_LONG_PREFILL_MERGE=torch by torch ops in
float32 (merge).

The queries reach every cuDNN part as rows of the model's qkv ([H, rows, D] at the qkv's row
stride; a padded copy at the same strides for a chunk short of its bucket) and cuDNN serves the KV
groups, as for the square; the warm-up builds every plan at that stride. Only a tail on flash has
them folded, each KV group's heads into the query length, by one Triton pass (triton_fold.fold_into;
FOLD_ENV=torch: a permuted copy and a fill); PREFIX_ENV=folded folds them for the prefix parts too,
as until the 59th session.

Where a sequence's pages through the chunk lie in one run of ascending block ids (page_run_start:
the runner's host check, AttentionMetadata.page_runs), the pool itself is laid out as a gather
buffer would be, so the prefix parts read it in place and nothing is gathered (GATHER_ENV=always:
gather anyway). The allocator hands a prompt all its blocks at admission, in free-queue order, so
a fresh pool's long prompts get such runs; a pool that has cycled rarely does. On the H100 the
gathers took 69.5 ms of a 100k prefill's 6.8 s (docs/long-context-history.md, 50th session).

The parts go through `prefix_attention(q [1, H, R, D] (folded [1, Hkv, R, D] under PREFIX_ENV=folded),
k [1, Hkv, S, D], v, scale)` and `square_attention(q [1, H, R, D], k, v, scale)` (cuDNN) and
`flash_attention(q, k, v, causal, scale)` -> (out, lse [.., R]); CPU tests pass their own.

The path's host-side plan (its thresholds and buckets, which chunks take it, their page runs) is
gathered_prefill_plan.py, read here as plan.X at every use, so that what a test or a benchmark sets
there holds here too; its switches (the PAGEDSERVE_LONG_PREFILL* variables, enabled() among them)
are gathered_prefill_switches.py.
"""
from __future__ import annotations

import torch

from pagedserve.attention import gathered_prefill_plan as plan
from pagedserve.attention.gathered_prefill_switches import (enabled, first_chunk_tokens, fold_kernel, merge_kernel,
                                                            pages_in_place, prefix_gqa, square_gqa, tail_on_cudnn)


# device -> GatheredPrefill: the pools long chunks on that device are routed for (configure).
_ACTIVE: dict = {}


def configure(device: torch.device, max_model_len: int, num_kv_heads: int, head_dim: int,
              dtype: torch.dtype) -> GatheredPrefill | None:
    """At start-up, before the KV pool is sized (so the profile counts the buffers): where the
    switch is on for this CUDA device (enabled), for a bf16/fp16 pool whose max_model_len admits a
    long chunk, route this device's long chunks here; otherwise route none, whatever an earlier
    engine in this process set."""
    if device.type != "cuda":
        return None
    key = torch.device("cuda", device.index if device.index is not None else torch.cuda.current_device())
    _ACTIVE.pop(key, None)
    on = enabled(key)  # first: a bad switch value is an error whatever the pool
    # Only where a chunk can ever take the path (else its buffers and plans would be dead weight).
    first = first_chunk_tokens()
    long_fits = max_model_len >= plan.MIN_PREFIX + plan.MIN_CHUNK or (first > 0 and max_model_len >= first)
    if on and dtype in (torch.bfloat16, torch.float16) and long_fits:
        _ACTIVE[key] = GatheredPrefill(max_model_len, num_kv_heads, head_dim, dtype, key,
                                       merge_into=merge_kernel(), fold_into=fold_kernel(),
                                       first_chunk_tokens=first,
                                       square_gqa=square_gqa(), tail_on_cudnn=tail_on_cudnn(),
                                       pages_in_place=pages_in_place(), prefix_gqa=prefix_gqa())
    return _ACTIVE.get(key)


def active(device: torch.device) -> GatheredPrefill | None:
    """The path's buffers for pools on `device` (a pool's own device, 'cuda:N'), or None."""
    return _ACTIVE.get(device)


def step_takes(meta, k_cache: torch.Tensor) -> bool:
    """Whether any sequence of this step takes the path on k_cache's device (the runner then runs
    the step eagerly, not as a full graph, whose unified kernel would attend the long chunk)."""
    g = active(k_cache.device)
    return g is not None and bool(plan.long_chunks(meta, k_cache, g.first_chunk_tokens))


def cudnn_prefix(q, k, v, scale):
    return torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, False, False, scale=scale)[:2]


def cudnn_causal(q, k, v, scale):
    return torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, True, False, scale=scale)[:2]


def flash(q, k, v, causal, scale):
    return torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False, scale=scale)[:2]


def heads_first(buf: torch.Tensor, start: int, end: int) -> torch.Tensor:
    """Positions [start, end) of a gather buffer ([positions, Hkv, D]) as [1, Hkv, end - start, D]:
    a strided view (each row's D values contiguous), no copy."""
    return buf[start:end].permute(1, 0, 2).unsqueeze(0)


def square_kv(buf: torch.Tensor, start: int, rows: int, group: int) -> torch.Tensor:
    """Positions [start, start + rows) of buf ([positions, Hkv, D]: a gather buffer or a pool's run
    of pages) for the square's query heads: with group 1 the strided view
    [1, Hkv, rows, D] (GatheredPrefill.square_keys passes 1 under SQUARE_ENV's 'gqa': cuDNN serves
    it as grouped-query attention, query head h reading KV head h // (H / Hkv)); else a copy
    repeated over each KV head's group of query heads, [1, Hkv * group, rows, D]."""
    if group == 1:
        return heads_first(buf, start, start + rows)
    return buf[start:start + rows].repeat_interleave(group, dim=1).permute(1, 0, 2).unsqueeze(0)


class GatheredPrefill:
    """The gather buffers of one pool layout ([positions, Hkv, D], as the pool's pages lay their
    rows out, so one index_select fills them), sized for max_model_len plus a query bucket of
    padding and made before the KV pool is sized (so the start-up profile counts them); shared by
    all layers, which run one at a time."""

    def __init__(self, max_model_len: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device, prefix_attention=cudnn_prefix, flash_attention=flash,
                 square_attention=cudnn_causal, merge_into=None, fold_into=None,
                 first_chunk_tokens: int = 0,
                 square_gqa: bool = False, tail_on_cudnn: bool = False, pages_in_place: bool = False,
                 prefix_gqa: bool = False):
        # Past max_model_len: the square's padding (< a query bucket) and the last page's spare slots.
        length = plan.bucket(max_model_len, plan.QUERY_BUCKET) + plan.QUERY_BUCKET + plan.MAX_PAGE
        self.k = torch.empty(length, num_kv_heads, head_dim, dtype=dtype, device=device)
        self.v = torch.empty_like(self.k)
        self.prefix_attention, self.flash_attention = prefix_attention, flash_attention
        self.square_attention = square_attention
        self.merge_into = merge_into  # None: merge (torch ops); else merge_into(parts, out) -> out
        self.fold_into = fold_into  # None: a permuted copy and a fill; else fold_into(q, out [H, rows, D])
        self.first_chunk_tokens = first_chunk_tokens  # takes()'s first_chunk
        self.square_gqa = square_gqa  # the square's K/V as Hkv heads (SQUARE_ENV), not repeated to H
        self.tail_on_cudnn = tail_on_cudnn  # whole-step prefix tails to cuDNN (TAIL_ENV), not flash
        self.pages_in_place = pages_in_place  # a run of pages read in the pool (GATHER_ENV), not gathered
        self.prefix_gqa = prefix_gqa  # the queries unfolded for the prefix parts too (PREFIX_ENV)
        # Layer-chunks whose context was read in place / gathered since start-up (benchmarks read them).
        self.chunks_in_place = self.chunks_gathered = 0
        self.max_model_len = max_model_len
        self.num_heads: int | None = None  # the query heads warm_up_plans built plans for
        # The query row strides (queries are views of the step's qkv) whose first-chunk square plans
        # on the queries in place warm_up_plans built; a first chunk with another takes the copy.
        self.first_q_row_strides: set[int] = set()
        # Under prefix_gqa, the query row stride every chunk's plans were built at (warm_up_plans:
        # the model's qkv width); None, no plans of that kind: the folded path.
        self.gqa_q_row_stride: int | None = None

    def square_keys(self, k: torch.Tensor, v: torch.Tensor, start: int, rows: int,
                    group: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The square's K and V (square_kv) out of k and v ([positions, Hkv, D]): the KV heads as
        they are under square_gqa, else repeated over each one's group of query heads."""
        sq = 1 if self.square_gqa else group
        return square_kv(k, start, rows, sq), square_kv(v, start, rows, sq)

    def chunks(self, meta, query: torch.Tensor, k_cache: torch.Tensor) -> list[int]:
        """long_chunks of a step, for a pool of the layout these buffers and plans are for: another
        model's attention on the device (a draft model's, with its own KV heads, head size or query
        heads) keeps its chunks on the Triton kernels, not this path's buffers and plans."""
        if (k_cache.shape[2:] != self.k.shape[1:] or k_cache.dtype != self.k.dtype
                or self.num_heads not in (None, query.shape[1])):
            return []
        return plan.long_chunks(meta, k_cache, self.first_chunk_tokens)

    def context(self, k_cache: torch.Tensor, v_cache: torch.Tensor, table: torch.Tensor, seq_len: int,
                c: int, rows: int, first_page: int | None) -> tuple[torch.Tensor, ...]:
        """(K, V, square K, square V, square start): the context's K and V as [positions, Hkv, D]
        (positions [0, seq_len) its tokens), and the [positions, Hkv, D] the square's rows x rows
        keys start in at square start, zeros past the chunk. The pool's own run of pages from
        first_page (pages_in_place; a padded square's keys copied to the buffers' start), or the
        pages gathered into the buffers."""
        bs, kv_heads, D = k_cache.shape[1:]
        n_pages, prefix = -(-seq_len // bs), seq_len - c
        # A pool whose pages are not laid end to end (another model's layout) is gathered: its
        # run would flatten into a copy.
        if first_page is not None and self.pages_in_place and k_cache.is_contiguous() and v_cache.is_contiguous():
            self.chunks_in_place += 1
            k, v = (pool[first_page:first_page + n_pages].flatten(0, 1) for pool in (k_cache, v_cache))
            if c == rows:  # the square's keys are the chunk's own rows, in place
                return k, v, k, v, prefix
            for src, buf in ((k, self.k), (v, self.v)):
                buf[:c].copy_(src[prefix:seq_len])
                buf[c:rows].zero_()  # the square's padded keys: zeros, not stale (NaN) rows
            return k, v, self.k, self.v, 0
        self.chunks_gathered += 1
        pages = table[:n_pages].long()
        for pool, buf in ((k_cache, self.k), (v_cache, self.v)):
            torch.index_select(pool, 0, pages, out=buf[: n_pages * bs].view(n_pages, bs, kv_heads, D))
            buf[seq_len: prefix + rows].zero_()  # the square's padded keys: zeros, not stale (NaN) rows
        return self.k, self.v, self.k, self.v, prefix

    def attend(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, table: torch.Tensor,
               seq_len: int, scale: float, out: torch.Tensor | None = None,
               first_page: int | None = None) -> torch.Tensor:
        """q [c, H, D], the chunk's last token at position seq_len - 1, its K/V already in the pool
        (table: its block table row; first_page: where its pages through seq_len lie in one run of
        the pool, page_run_start's); its causal attention over its context, [c, H, D] (written into
        out where given, and returned)."""
        c, H, D = q.shape
        prefix, bs, kv_heads = seq_len - c, k_cache.shape[1], k_cache.shape[2]
        group, rows = H // kv_heads, plan.bucket(c, plan.QUERY_BUCKET)
        if bs > plan.MAX_PAGE:
            raise ValueError(f"gathered long prefill: pages of {bs} tokens, at most {plan.MAX_PAGE}")
        ctx_k, ctx_v, sq_k, sq_v, square_at = self.context(k_cache, v_cache, table, seq_len, c, rows, first_page)
        head = prefix // plan.PREFIX_BUCKET * plan.PREFIX_BUCKET
        square_keys = self.square_keys(sq_k, sq_v, square_at, rows, group)
        if prefix == 0 and c == rows and q.stride()[1:] == (D, 1) and q.stride(0) in self.first_q_row_strides:
            # A first chunk filling its bucket: the square alone, its queries read where they are
            # ([1, H, c, D] strided; cuDNN lays its output out alike, so the copy below is the only one).
            o, _ = self.square_attention(q.permute(1, 0, 2).unsqueeze(0), *square_keys, scale)
            return o[0].transpose(0, 1) if out is None else out.copy_(o[0].transpose(0, 1))
        # Query head h = KV head h // group. unfolded: [1, H, rows, D] strided as the qkv lays them
        # (prefix_gqa; cuDNN serves the groups). folded: [Hkv, group, rows, D], which viewed
        # [1, H, rows, D] is the square's queries and [1, Hkv, group * rows, D] the prefix parts',
        # each group folded into the query length; made where some part takes it.
        flash_tail = prefix > head and not (self.tail_on_cudnn and (prefix - head) % plan.TAIL_STEP == 0)
        unfolded = self.unfolded_queries(q, rows)
        folded = self.fold_queries(q, kv_heads, rows) if unfolded is None or flash_tail else None
        qf = None if folded is None else folded.view(1, kv_heads, group * rows, D)
        prefix_q = qf if unfolded is None else unfolded
        parts = []
        # (1) the bucketed head of the prefix: cuDNN, at a shape the warm-up built.
        if head:
            parts.append(self.prefix_attention(prefix_q, heads_first(ctx_k, 0, head), heads_first(ctx_v, 0, head),
                                               scale))
        # (2) the prefix's tail past the bucket: cuDNN at a built shape where it is whole TAIL_STEPs,
        # else flash (no plans; its queries folded).
        if prefix > head:
            kt, vt = heads_first(ctx_k, head, prefix), heads_first(ctx_v, head, prefix)
            parts.append(self.flash_attention(qf, kt, vt, False, scale) if flash_tail
                         else self.prefix_attention(prefix_q, kt, vt, scale))
        # (3) the chunk's own square padded to rows x rows, causal (top-left; a real row never sees
        # a padded key): cuDNN, one plan per query bucket.
        square_q = folded.view(1, H, rows, D) if unfolded is None else unfolded
        parts.append(self.square_attention(square_q, *square_keys, scale))
        parts = [(o.reshape(H, rows, D), lse.reshape(H, rows)) for o, lse in parts]
        if len(parts) == 1:  # a first chunk: its square alone
            merged = parts[0][0][:, :c].transpose(0, 1)
        elif self.merge_into is not None:
            return self.merge_into(parts, q.new_empty(c, H, D) if out is None else out)
        else:
            merged = merge(parts)[:, :c].transpose(0, 1)
        return merged if out is None else out.copy_(merged)

    def fold_queries(self, q: torch.Tensor, kv_heads: int, rows: int) -> torch.Tensor:
        """q [c, H, D] as [Hkv, group, rows, D], contiguous, zero rows past c (fold_into's one pass,
        or a permuted copy and a fill)."""
        c, H, D = q.shape
        folded = q.new_empty(kv_heads, H // kv_heads, rows, D)
        if self.fold_into is not None:
            self.fold_into(q, folded.view(H, rows, D))
        else:
            folded[:, :, :c] = q.view(c, kv_heads, H // kv_heads, D).permute(1, 2, 0, 3)
            folded[:, :, c:].zero_()  # the padding rows (their outputs are dropped): zeros, not stale NaNs
        return folded

    def unfolded_queries(self, q: torch.Tensor, rows: int) -> torch.Tensor | None:
        """Under prefix_gqa, q ([c, H, D]) as [1, H, rows, D] with its rows gqa_q_row_stride apart,
        the strides the warm-up built every plan at: q itself where it is rows of the model's qkv
        and fills its query bucket, else a copy at those strides padded with zero rows (a chunk
        short of its bucket; queries laid out otherwise). None without such plans (the folded path)."""
        c, H, D = q.shape
        stride = self.gqa_q_row_stride
        if not self.prefix_gqa or stride is None:
            return None
        if c < rows or q.stride() != (stride, D, 1):
            padded = q.new_empty(rows, stride)[:, :H * D].view(rows, H, D)
            padded[:c].copy_(q)
            padded[c:].zero_()  # the padding rows (their outputs are dropped): zeros, not stale NaNs
            q = padded
        return q.permute(1, 0, 2).unsqueeze(0)

    def shapes(self, max_tokens: int) -> list[tuple[int, int]]:
        """Every (query rows, keys) a chunk's prefix parts can meet on cuDNN: its bucketed head and,
        under tail_on_cudnn, a tail of whole TAIL_STEPs: the prefix plans warm_up_plans builds."""
        heads = range(plan.MIN_PREFIX // plan.PREFIX_BUCKET * plan.PREFIX_BUCKET,
                      (self.max_model_len - plan.MIN_CHUNK) // plan.PREFIX_BUCKET * plan.PREFIX_BUCKET + 1,
                      plan.PREFIX_BUCKET)
        keys = [h for h in heads if h > 0]
        if self.tail_on_cudnn:
            keys += [t for t in range(plan.TAIL_STEP, min(plan.PREFIX_BUCKET, self.max_model_len), plan.TAIL_STEP)
                     if t not in keys]
        return [(r, n) for r in plan.query_rows(max_tokens) for n in keys]


def warm_up_plans(g: GatheredPrefill, max_tokens: int, num_heads: int, scale: float,
                  q_row_stride: int | None = None) -> int:
    """Run cuDNN once at every prefix shape of g.shapes(max_tokens) and every square of
    query_rows(max_tokens), with the strides attend gives it (cuDNN builds and caches each plan),
    and flash once (its kernels load on first use); returns the plans run. q_row_stride: the
    model's query rows' stride (its qkv's width), for first chunks' squares on their queries in place."""
    _, kv_heads, head_dim = g.k.shape
    group = num_heads // kv_heads
    g.num_heads = num_heads
    shapes = g.shapes(max_tokens)
    g.k.zero_(), g.v.zero_()
    # prefix_gqa: every chunk's queries reach cuDNN unfolded, at the qkv's row stride (attend).
    unfolded = g.prefix_gqa and q_row_stride is not None

    def strided_queries(rows: int) -> torch.Tensor:  # [1, H, rows, D], rows q_row_stride apart
        return g.k.new_zeros(rows, q_row_stride)[:, :num_heads * head_dim].view(
            rows, num_heads, head_dim).permute(1, 0, 2).unsqueeze(0)
    for rows, head in shapes:
        q = strided_queries(rows) if unfolded else g.k.new_zeros(1, kv_heads, group * rows, head_dim)
        g.prefix_attention(q, heads_first(g.k, 0, head), heads_first(g.v, 0, head), scale)
    squares = plan.query_rows(max_tokens)
    for rows in squares:
        q = strided_queries(rows) if unfolded else g.k.new_zeros(1, num_heads, rows, head_dim)
        g.square_attention(q, *g.square_keys(g.k, g.v, 0, rows, group), scale)
    if unfolded:
        g.gqa_q_row_stride = q_row_stride
    # A first chunk filling its bucket hands cuDNN its queries as a strided view: other strides, other
    # plans (under prefix_gqa, the squares' just built).
    firsts = [r for r in squares if q_row_stride and g.first_chunk_tokens and r >= g.first_chunk_tokens]
    if firsts:
        g.first_q_row_strides.add(q_row_stride)
    if unfolded:
        firsts = []
    for rows in firsts:
        g.square_attention(strided_queries(rows), *g.square_keys(g.k, g.v, 0, rows, group), scale)
    q = g.k.new_zeros(1, kv_heads, group * plan.QUERY_BUCKET, head_dim)
    g.flash_attention(q, heads_first(g.k, 0, plan.QUERY_BUCKET), heads_first(g.v, 0, plan.QUERY_BUCKET), False, scale)
    if g.fold_into is not None:  # its kernel compiles once (per dtype and head size): here, not while serving
        g.fold_into(g.k.new_zeros(plan.QUERY_BUCKET // 2, num_heads, head_dim),
                    g.k.new_empty(num_heads, plan.QUERY_BUCKET, head_dim))
    if g.merge_into is not None:  # its kernel compiles once per part count: here, not while serving
        part = (g.k.new_zeros(num_heads, plan.QUERY_BUCKET, head_dim),
                g.k.new_zeros(num_heads, plan.QUERY_BUCKET).float())
        for n in (2, 3):
            g.merge_into([part] * n, g.k.new_empty(plan.QUERY_BUCKET, num_heads, head_dim))
    return len(shapes) + len(squares) + len(firsts)


def merge(parts: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """Softmax attentions of the same queries over disjoint keys ([H, c, D] each with its [H, c]
    log-sum-exp) as the attention over their union, in float32 at least."""
    acc = torch.promote_types(parts[0][0].dtype, torch.float32)
    lses = torch.stack([lse.to(acc) for _, lse in parts])
    weights = (lses - lses.max(0).values).exp().unsqueeze(-1)
    total = sum(w * out.to(acc) for w, (out, _) in zip(weights, parts))
    return (total / weights.sum(0)).to(parts[0][0].dtype)
