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
    one plan per query bucket. It ran on
    flash in the second version (1.25 s of a 100k prefill, with (2): docs/long-context.md).
The parts are merged by their log-sum-exps. A first version padded the prefix to the bucket and
masked the pad with a broadcast bias row instead of (2): cuDNN's biased kernel ran at 256-377
TFLOPS, slower than ours (docs/long-context.md). Chunks shorter than MIN_CHUNK or after fewer than
MIN_PREFIX tokens stay on the Triton kernel, except first chunks of FIRST_CHUNK_DEFAULT+ tokens
(FIRST_CHUNK_ENV): their square alone, on cuDNN's causal kernel, which then reads the queries
where they are (a strided view, as long as the chunk fills its query bucket) instead of a copy.

The parts are merged in one Triton pass straight into the layer's output (triton_merge.merge_into),
or with PAGEDSERVE_LONG_PREFILL_MERGE=torch by torch ops in float32 (merge). On the H200 the two
defaults took a whole 100k prefill from 7.23-7.28 s to 7.00-7.01 s (the merge alone: 7.01-7.06 s),
runs/s34_long_context/ in benchmarks/results/h200/history.tar.gz.

The queries are folded for cuDNN by one Triton pass (triton_fold.fold_into; FOLD_ENV=torch: a
permuted copy and a fill, as until the 39th session).

Where a sequence's pages through the chunk lie in one run of ascending block ids (page_run_start:
the runner's host check, AttentionMetadata.page_runs), the pool itself is laid out as a gather
buffer would be, so the prefix parts read it in place and nothing is gathered (GATHER_ENV=always:
gather anyway). The allocator hands a prompt all its blocks at admission, in free-queue order, so
a fresh pool's long prompts get such runs; a pool that has cycled rarely does. On the H100 the
gathers took 69.5 ms of a 100k prefill's 6.8 s (docs/long-context.md).

The parts go through `prefix_attention(q [1, Hkv, R, D], k [1, Hkv, S, D], v, scale)` and
`square_attention(q [1, H, R, D], k, v, scale)` (cuDNN) and `flash_attention(q, k, v, causal,
scale)` -> (out, lse [.., R]); CPU tests pass their own.
"""
from __future__ import annotations

import importlib
import os

import torch

LONG_PREFILL_ENV = "PAGEDSERVE_LONG_PREFILL"
MERGE_ENV = "PAGEDSERVE_LONG_PREFILL_MERGE"  # 'triton' (default) or 'torch': how the parts are merged
FOLD_ENV = "PAGEDSERVE_LONG_PREFILL_FOLD"  # 'triton' (default) or 'torch': how the queries are folded
# N > 0: a chunk of at least N tokens after fewer than PREFIX_BUCKET (a prompt's first chunk, or one
# after a short cached prefix) takes the path too: its square on cuDNN's causal kernel (on the H200
# 0.88 against our prefill kernel's 1.42 ms a layer at 8192 x 8192, runs/s27_long_prefill/), the few
# earlier tokens on flash. 0: off.
FIRST_CHUNK_ENV = "PAGEDSERVE_LONG_PREFILL_FIRST"
FIRST_CHUNK_DEFAULT = 4096
# How the chunk's square meets cuDNN: 'gqa' (the default) hands it the KV heads as they are (cuDNN
# reads a KV head for each of its group's query heads); 'repeat' copies them once per query head
# first, as until the 36th session (two [c, H, D] copies a layer: ~118 ms of a 100k prefill's
# 7.3 s in runs/s33_prefill_profile/).
SQUARE_ENV = "PAGEDSERVE_LONG_PREFILL_SQUARE"
# Where the prefix's tail past its bucketed head goes when it is a whole number of TAIL_STEP
# tokens: 'cudnn' (the default since the 38th session: chunks sized by cost beside decodes leave
# such tails on most chunks) or 'flash' (as before: torch's flash kernel, no plans).
TAIL_ENV = "PAGEDSERVE_LONG_PREFILL_TAIL"
# 'runs' (the default): a chunk whose pages lie in one run of the pool reads them in place;
# 'always': every chunk's context is gathered first, as until the 52nd session.
GATHER_ENV = "PAGEDSERVE_LONG_PREFILL_GATHER"
PREFIX_BUCKET = 8192
QUERY_BUCKET = 1024
TAIL_STEP = 1024  # core/chunk_cost.CHUNK_ALIGN: aligned chunks leave tails of whole steps
# A chunk after fewer earlier tokens stays on the Triton kernel (or, as a first chunk, takes the
# square alone). 16,384 until the 36th session: the H200's serving budget cuts a 32k prompt into
# 8,192-token chunks, and the second (8,192 earlier) then ran on our kernel (~400 TFLOPS against
# cuDNN's ~600, ~1.6 TFLOP a layer), about 3% of the prompt's prefill (docs/long-context.md).
MIN_PREFIX = 8192
MIN_CHUNK = 1024
MAX_PAGE = 1024  # config.CacheConfig's largest block_size


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
    long_fits = max_model_len >= MIN_PREFIX + MIN_CHUNK or (first > 0 and max_model_len >= first)
    if on and dtype in (torch.bfloat16, torch.float16) and long_fits:
        _ACTIVE[key] = GatheredPrefill(max_model_len, num_kv_heads, head_dim, dtype, key,
                                       merge_into=merge_kernel(), fold_into=fold_kernel(),
                                       first_chunk_tokens=first,
                                       square_gqa=square_gqa(), tail_on_cudnn=tail_on_cudnn(),
                                       pages_in_place=pages_in_place())
    return _ACTIVE.get(key)


def first_chunk_tokens() -> int:
    """FIRST_CHUNK_ENV's value (FIRST_CHUNK_DEFAULT unset): 0 (off) or the fewest tokens a first
    chunk needs."""
    value = os.environ.get(FIRST_CHUNK_ENV, "").strip() or str(FIRST_CHUNK_DEFAULT)
    # Below MIN_CHUNK a short chunk would be padded to a whole query bucket for cuDNN.
    if not value.isdigit() or 0 < int(value) < MIN_CHUNK:
        raise ValueError(f"{FIRST_CHUNK_ENV}={value!r}: expected 0 (off) or a whole number of tokens >= {MIN_CHUNK}")
    return int(value)


def square_gqa() -> bool:
    """SQUARE_ENV's choice: True for 'gqa' (the default), False for 'repeat'."""
    value = os.environ.get(SQUARE_ENV, "").strip() or "gqa"
    if value not in ("gqa", "repeat"):
        raise ValueError(f"{SQUARE_ENV}={value!r}: expected 'gqa' (the default) or 'repeat'")
    return value == "gqa"


def tail_on_cudnn() -> bool:
    """TAIL_ENV's choice: True for 'cudnn' (the default), False for 'flash'."""
    value = os.environ.get(TAIL_ENV, "").strip() or "cudnn"
    if value not in ("cudnn", "flash"):
        raise ValueError(f"{TAIL_ENV}={value!r}: expected 'cudnn' (the default) or 'flash'")
    return value == "cudnn"


def pages_in_place() -> bool:
    """GATHER_ENV's choice: True for 'runs' (the default), False for 'always'."""
    value = os.environ.get(GATHER_ENV, "").strip() or "runs"
    if value not in ("runs", "always"):
        raise ValueError(f"{GATHER_ENV}={value!r}: expected 'runs' (the default) or 'always'")
    return value == "runs"


def page_run_start(table: list[int], num_pages: int) -> int | None:
    """The first block id of table[:num_pages] where those pages are one run of ascending ids
    (first, first + 1, ...), else None."""
    if num_pages <= 0 or len(table) < num_pages:
        return None
    first = table[0]
    if table[num_pages - 1] - first != num_pages - 1:
        return None
    return first if table[:num_pages] == list(range(first, first + num_pages)) else None


def page_runs(block_tables: list[list[int]], query_lens: list[int], seq_lens: list[int], num_decodes: int,
              block_size: int) -> dict[int, int] | None:
    """AttentionMetadata.page_runs from the step's host tables: for each prefill sequence with a
    chunk long enough for this path (MIN_CHUNK tokens), the first block of its pages through the
    chunk where they lie in one run; None where there is none (one list compare per long chunk)."""
    runs = {}
    for i in range(num_decodes, len(block_tables)):
        if query_lens[i] >= MIN_CHUNK:
            first = page_run_start(block_tables[i], -(-seq_lens[i] // block_size))
            if first is not None:
                runs[i] = first
    return runs or None


def _triton_kernel(env: str, module: str, name: str):
    """A two-way switch between one of this path's Triton kernels and torch ops: 'triton' (or
    unset) gives the kernel, pagedserve.attention.<module>.<name>; 'torch' gives None."""
    value = os.environ.get(env, "").strip() or "triton"
    if value not in ("torch", "triton"):
        raise ValueError(f"{env}={value!r}: expected 'triton' (the default) or 'torch'")
    return getattr(importlib.import_module(f"pagedserve.attention.{module}"), name) if value == "triton" else None


def merge_kernel():
    """MERGE_ENV's merge: triton_merge.merge_into (the default) or None (torch ops)."""
    return _triton_kernel(MERGE_ENV, "triton_merge", "merge_into")


def fold_kernel():
    """FOLD_ENV's fold: triton_fold.fold_into (the default) or None (a permuted copy and a fill)."""
    return _triton_kernel(FOLD_ENV, "triton_fold", "fold_into")


def active(device: torch.device) -> GatheredPrefill | None:
    """The path's buffers for pools on `device` (a pool's own device, 'cuda:N'), or None."""
    return _ACTIVE.get(device)


def enabled(device: torch.device) -> bool:
    """The switch on `device`: unset (or 'auto'): on for Hopper GPUs (sm90), where it was measured
    (a 100k prefill 8.59 -> 7.64 s on the H200, docs/long-context.md), off elsewhere; 'cudnn': on
    for any CUDA GPU; 'off' or '0': off."""
    value = os.environ.get(LONG_PREFILL_ENV, "").strip()
    if value not in ("", "auto", "off", "0", "cudnn"):
        raise ValueError(f"{LONG_PREFILL_ENV}={value!r}: expected 'cudnn', 'off' (or '0'), or unset "
                         "('auto': on for Hopper GPUs)")
    if value in ("", "auto"):
        return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] == 9
    return value == "cudnn" and device.type == "cuda"


def takes(query_len: int, seq_len: int, first_chunk: int = 0) -> bool:
    """Whether a prefill chunk of query_len new tokens ending at seq_len takes this path: after at
    least MIN_PREFIX tokens; with first_chunk > 0 (FIRST_CHUNK_ENV) also a chunk of at least that
    many tokens after fewer than PREFIX_BUCKET (no prefix head, so no plan but the square's)."""
    prefix = seq_len - query_len
    if query_len >= MIN_CHUNK and prefix >= MIN_PREFIX:
        return True
    return 0 < first_chunk <= query_len and prefix < PREFIX_BUCKET


def long_chunks(meta, k_cache: torch.Tensor, first_chunk: int = 0) -> list[int]:
    """The step's prefill sequences (indices) that take this path: from the host lengths, never a
    sync; none from an fp8 pool (its scales are the Triton kernels')."""
    if meta.query_lens_cpu is None or meta.seq_lens_cpu is None or k_cache.element_size() == 1:
        return []
    return [i for i in range(meta.num_decodes, meta.num_seqs)
            if takes(meta.query_lens_cpu[i], meta.seq_lens_cpu[i], first_chunk)]


def step_takes(meta, k_cache: torch.Tensor) -> bool:
    """Whether any sequence of this step takes the path on k_cache's device (the runner then runs
    the step eagerly, not as a full graph, whose unified kernel would attend the long chunk)."""
    g = active(k_cache.device)
    return g is not None and bool(long_chunks(meta, k_cache, g.first_chunk_tokens))


def other_ranges(first: int, end: int, skip: list[int]) -> list[tuple[int, int]]:
    """[first, end) less the sequences in skip, as (first, count) runs of consecutive sequences."""
    runs, start = [], first
    for i in sorted(skip) + [end]:
        if i > start:
            runs.append((start, i - start))
        start = i + 1
    return runs


def bucket(n: int, step: int) -> int:
    return -(-n // step) * step


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
                 square_gqa: bool = False, tail_on_cudnn: bool = False, pages_in_place: bool = False):
        # Past max_model_len: the square's padding (< a query bucket) and the last page's spare slots.
        length = bucket(max_model_len, QUERY_BUCKET) + QUERY_BUCKET + MAX_PAGE
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
        # Layer-chunks whose context was read in place / gathered since start-up (benchmarks read them).
        self.chunks_in_place = self.chunks_gathered = 0
        self.max_model_len = max_model_len
        self.num_heads: int | None = None  # the query heads warm_up_plans built plans for
        # The query row strides (queries are views of the step's qkv) whose first-chunk square plans
        # on the queries in place warm_up_plans built; a first chunk with another takes the copy.
        self.first_q_row_strides: set[int] = set()

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
        return long_chunks(meta, k_cache, self.first_chunk_tokens)

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
        group, rows = H // kv_heads, bucket(c, QUERY_BUCKET)
        if bs > MAX_PAGE:
            raise ValueError(f"gathered long prefill: pages of {bs} tokens, at most {MAX_PAGE}")
        ctx_k, ctx_v, sq_k, sq_v, square_at = self.context(k_cache, v_cache, table, seq_len, c, rows, first_page)
        head = prefix // PREFIX_BUCKET * PREFIX_BUCKET
        square_keys = self.square_keys(sq_k, sq_v, square_at, rows, group)
        if prefix == 0 and c == rows and q.stride()[1:] == (D, 1) and q.stride(0) in self.first_q_row_strides:
            # A first chunk filling its bucket: the square alone, its queries read where they are
            # ([1, H, c, D] strided; cuDNN lays its output out alike, so the copy below is the only one).
            o, _ = self.square_attention(q.permute(1, 0, 2).unsqueeze(0), *square_keys, scale)
            return o[0].transpose(0, 1) if out is None else out.copy_(o[0].transpose(0, 1))
        # Query head h = KV head h // group: [Hkv, group, rows, D] is the square's [H, rows, D] and,
        # viewed [1, Hkv, group * rows, D], the prefix parts' queries with each group folded in.
        folded = q.new_empty(kv_heads, group, rows, D)
        if self.fold_into is not None:
            self.fold_into(q, folded.view(H, rows, D))
        else:
            folded[:, :, :c] = q.view(c, kv_heads, group, D).permute(1, 2, 0, 3)
            folded[:, :, c:].zero_()  # the padding rows (their outputs are dropped): zeros, not stale NaNs
        qf = folded.view(1, kv_heads, group * rows, D)
        parts = []
        # (1) the bucketed head of the prefix: cuDNN, at a shape the warm-up built.
        if head:
            parts.append(self.prefix_attention(qf, heads_first(ctx_k, 0, head), heads_first(ctx_v, 0, head), scale))
        # (2) the prefix's tail past the bucket, folded likewise: cuDNN at a built shape where it is
        # whole TAIL_STEPs, else flash (no plans).
        if prefix > head:
            kt, vt = heads_first(ctx_k, head, prefix), heads_first(ctx_v, head, prefix)
            if self.tail_on_cudnn and (prefix - head) % TAIL_STEP == 0:
                parts.append(self.prefix_attention(qf, kt, vt, scale))
            else:
                parts.append(self.flash_attention(qf, kt, vt, False, scale))
        # (3) the chunk's own square padded to rows x rows, causal (top-left; a real row never sees
        # a padded key): cuDNN, one plan per query bucket.
        parts.append(self.square_attention(folded.view(1, H, rows, D), *square_keys, scale))
        parts = [(o.reshape(H, rows, D), lse.reshape(H, rows)) for o, lse in parts]
        if len(parts) == 1:  # a first chunk: its square alone
            merged = parts[0][0][:, :c].transpose(0, 1)
        elif self.merge_into is not None:
            return self.merge_into(parts, q.new_empty(c, H, D) if out is None else out)
        else:
            merged = merge(parts)[:, :c].transpose(0, 1)
        return merged if out is None else out.copy_(merged)

    def shapes(self, max_tokens: int) -> list[tuple[int, int]]:
        """Every (query rows, keys) a chunk's prefix parts can meet on cuDNN: its bucketed head and,
        under tail_on_cudnn, a tail of whole TAIL_STEPs: the prefix plans warm_up_plans builds."""
        heads = range(MIN_PREFIX // PREFIX_BUCKET * PREFIX_BUCKET,
                      (self.max_model_len - MIN_CHUNK) // PREFIX_BUCKET * PREFIX_BUCKET + 1, PREFIX_BUCKET)
        keys = [h for h in heads if h > 0]
        if self.tail_on_cudnn:
            keys += [t for t in range(TAIL_STEP, min(PREFIX_BUCKET, self.max_model_len), TAIL_STEP) if t not in keys]
        return [(r, n) for r in query_rows(max_tokens) for n in keys]


def query_rows(max_tokens: int) -> range:
    """The query buckets a chunk of at most max_tokens tokens can meet (each a square plan)."""
    return range(QUERY_BUCKET, bucket(max_tokens, QUERY_BUCKET) + 1, QUERY_BUCKET)


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
    for rows, head in shapes:
        q = g.k.new_zeros(1, kv_heads, group * rows, head_dim)
        g.prefix_attention(q, heads_first(g.k, 0, head), heads_first(g.v, 0, head), scale)
    squares = query_rows(max_tokens)
    for rows in squares:
        q = g.k.new_zeros(1, num_heads, rows, head_dim)
        g.square_attention(q, *g.square_keys(g.k, g.v, 0, rows, group), scale)
    # A first chunk filling its bucket hands cuDNN its queries as a strided view: other strides, other plans.
    firsts = [r for r in squares if q_row_stride and g.first_chunk_tokens and r >= g.first_chunk_tokens]
    for rows in firsts:
        q = g.k.new_zeros(rows, q_row_stride)[:, :num_heads * head_dim].view(rows, num_heads, head_dim)
        g.square_attention(q.permute(1, 0, 2).unsqueeze(0), *g.square_keys(g.k, g.v, 0, rows, group), scale)
    if firsts:
        g.first_q_row_strides.add(q_row_stride)
    q = g.k.new_zeros(1, kv_heads, group * QUERY_BUCKET, head_dim)
    g.flash_attention(q, heads_first(g.k, 0, QUERY_BUCKET), heads_first(g.v, 0, QUERY_BUCKET), False, scale)
    if g.fold_into is not None:  # its kernel compiles once (per dtype and head size): here, not while serving
        g.fold_into(g.k.new_zeros(QUERY_BUCKET // 2, num_heads, head_dim),
                    g.k.new_empty(num_heads, QUERY_BUCKET, head_dim))
    if g.merge_into is not None:  # its kernel compiles once per part count: here, not while serving
        part = (g.k.new_zeros(num_heads, QUERY_BUCKET, head_dim), g.k.new_zeros(num_heads, QUERY_BUCKET).float())
        for n in (2, 3):
            g.merge_into([part] * n, g.k.new_empty(QUERY_BUCKET, num_heads, head_dim))
    return len(shapes) + len(squares) + len(firsts)


def merge(parts: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """Softmax attentions of the same queries over disjoint keys ([H, c, D] each with its [H, c]
    log-sum-exp) as the attention over their union, in float32 at least."""
    acc = torch.promote_types(parts[0][0].dtype, torch.float32)
    lses = torch.stack([lse.to(acc) for _, lse in parts])
    weights = (lses - lses.max(0).values).exp().unsqueeze(-1)
    total = sum(w * out.to(acc) for w, (out, _) in zip(weights, parts))
    return (total / weights.sum(0)).to(parts[0][0].dtype)
