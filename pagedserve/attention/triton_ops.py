"""Triton paged attention: the GPU twins of reference.py, same signatures, same results.

KV pools are [num_blocks, block_size, num_kv_heads, head_dim] per layer (head_dim
contiguous). `paged_attention` sends the batch's decodes (the first meta.num_decodes
sequences, one query token each) to the split-K decode kernel and the rest (prefill
chunks, extends after a prefix-cache hit) to the varlen prefill kernel. Launch shapes
come only from host values in `meta`, so nothing here syncs the device. How the decode kernel
is launched (its tiles, warps, grid order, splits) is decode_plan.py's decision; this module
reads it from there at every call, so a test that patches decode_plan reaches these launches.
The pool writes (write_kv, rope_write_kv, copy_blocks) are triton_cache.py's, beside their
kernels; this module exports them, so that it is the whole backend (backend.py) as reference.py is.
"""
from __future__ import annotations

import dataclasses
import functools
import math

import torch

from pagedserve.attention import decode_plan, gathered_prefill, gathered_prefill_plan
from pagedserve.attention.metadata import AttentionMetadata
from pagedserve.attention.kv_quant import is_fp8
from pagedserve.attention.triton_cache import check_pool_layout, copy_blocks, fp8_scale_args, rope_write_kv, write_kv
from pagedserve.attention.triton_decode import paged_decode_kernel, reduce_splits_kernel
from pagedserve.attention.triton_prefill import prefill_attention, prefill_launch
from pagedserve.attention import triton_unified as unified
from pagedserve.host_math import next_power_of_2

# The backend (backend.py): the pool writes are triton_cache's, exported here beside the attention.
__all__ = ["copy_blocks", "longest_first", "paged_attention", "paged_decode", "paged_prefill", "rope_write_kv",
           "unified_capacity", "unified_paged_attention", "write_kv"]


@functools.lru_cache(maxsize=None)
def _sm90(device: torch.device) -> bool:
    """A Hopper GPU (compute capability 9.x): the prefill kernel's larger tiles fit its shared memory."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] == 9


def _pow2_at_least_16(n: int) -> int:
    return max(16, next_power_of_2(n))


def _ieee(query: torch.Tensor, cache: torch.Tensor) -> bool:
    """fp32 dots: a float32 cache, or an fp8 cache read by float32 queries (its tiles become q's dtype)."""
    return (query.dtype if is_fp8(cache) else cache.dtype) == torch.float32


def paged_decode(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 seq_lens: torch.Tensor, block_tables: torch.Tensor, max_seq_len: int, scale: float,
                 out: torch.Tensor, num_splits: int | None = None, block_n: int | None = None,
                 num_warps: int | None = None, num_stages: int | None = None,
                 split_tokens: int | None = None, share_programs: int | None = None,
                 min_chain_tiles: int | None = None, heads_fastest: bool | None = None,
                 order: torch.Tensor | None = None, k_scale: torch.Tensor | None = None,
                 v_scale: torch.Tensor | None = None, f16_dot: bool | None = None, window: int = 0,
                 window_lens: torch.Tensor | None = None, softcap: float = 0.0) -> torch.Tensor:
    """Decode attention for query [num_seqs, num_heads, head_dim] (one token per sequence) into out.
    window > 0: a sliding window, each row reading its last `window` positions (window_lens: the
    lengths clamped to it, when the caller has them already); softcap > 0: the scores soft-capped
    (cap * tanh(score / cap), Gemma 2's).
    The launch is decode_plan's: num_splits: each sequence's base split count (default:
    choose_num_splits); split_tokens: the length-aware splits (default: decode_split_tokens();
    0: every sequence in num_splits; BALANCED; SLOTS, the balanced cut in the slots' grid);
    share_programs, min_chain_tiles: the balanced plan's even share (defaults: the device's
    DECODE_SHARE_PROGRAMS_PER_SM per SM, MIN_TOKENS_PER_SPLIT in tiles), for tests and sweeps.
    heads_fastest: the grid is (KV head, sequence, split), so a sequence's heads, whose K/V rows
    are adjacent in the pool, run side by side; else (sequence, KV head, split). order: the rows in
    the order their programs should start (longest_first), or None for row order. block_n,
    num_warps, num_stages, heads_fastest, f16_dot: None takes decode_launch_for(k_cache.dtype)'s.
    f16_dot (an fp8 cache read by fp16/bf16 queries; else ignored): the tiles become fp16 and q is
    cast to fp16, saturated to +-65504, so the dots run in fp16 (fp32 accumulation either way)."""
    launch = decode_plan.decode_launch_for(k_cache.dtype)
    block_n = launch.block_n if block_n is None else block_n
    num_warps = launch.num_warps if num_warps is None else num_warps
    num_stages = launch.num_stages if num_stages is None else num_stages
    heads_fastest = launch.heads_fastest if heads_fastest is None else heads_fastest
    f16_dot = launch.f16_dot if f16_dot is None else f16_dot
    num_seqs, num_heads, head_dim = query.shape
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    layer_kw = {}
    if softcap > 0:
        layer_kw["SOFTCAP"] = float(softcap)
    if window > 0:  # the kernels plan over the windows (triton_decode's docstring)
        layer_kw.update(full_lens_ptr=seq_lens, WINDOW=window)
        seq_lens = seq_lens.clamp(max=window) if window_lens is None else window_lens
        max_seq_len = min(max_seq_len, window)
    base, splits, mode = decode_plan.decode_launch(num_seqs, num_kv_heads, max_seq_len, query.device,
                                                   num_splits, split_tokens)
    block_d = _pow2_at_least_16(head_dim)
    ieee = _ieee(query, k_cache)
    default_share, default_min_chain = decode_plan.balanced_share(query.device, block_n)
    share_programs = default_share if share_programs is None else share_programs
    min_chain_tiles = default_min_chain if min_chain_tiles is None else min_chain_tiles
    plan = dict(SPLIT_TOKENS=mode, SHARE_PROGRAMS=share_programs, MIN_CHAIN_TILES=min_chain_tiles)
    # Only when on, so that the default launch stays the compiled variant it was before the switch.
    cast = dict(F16_DOT=True) if f16_dot and is_fp8(k_cache) and not ieee else {}
    common = dict(GROUP=group, HEAD_DIM=head_dim, BLOCK_SIZE=k_cache.shape[1],
                  BLOCK_G=_pow2_at_least_16(group), BLOCK_D=block_d, BLOCK_N=block_n,
                  IEEE=ieee, num_warps=num_warps, num_stages=num_stages, HEADS_FASTEST=heads_fastest,
                  order_ptr=order, **plan, **cast, **fp8_scale_args(k_cache, k_scale, v_scale), **layer_kw)
    # SLOTS: (KV head, slot), as many slots as the plan can fill; else (KV head, sequence, split).
    if mode == decode_plan.SLOTS:
        cells, per_cell = decode_plan.balanced_slots(num_seqs, num_kv_heads, base, splits, share_programs), 1
    else:
        cells, per_cell = num_seqs, splits
    grid = (num_kv_heads, cells, per_cell) if heads_fastest else (cells, num_kv_heads, per_cell)
    if splits == 1:
        # No reduction: the split buffers are never written, but they are float32 pointers here
        # too, so that this launch is the same compiled variant as a split one (a bf16 `out` in
        # their place was a variant of its own, which only eager steps met: it compiled after
        # start-up when graphs took every warm-up step that had decodes).
        unused = torch.empty(1, dtype=torch.float32, device=query.device)
        paged_decode_kernel[grid](
            query, k_cache, v_cache, out, unused, unused, seq_lens, block_tables, scale * math.log2(math.e),
            query.stride(0), query.stride(1), out.stride(0), out.stride(1),
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
            0, 0, 0, 0, 0, base, splits, num_seqs, **common)
        return out
    # Split results by (cell, head, split): (sequence, head, split), or SLOTS (slot, head).
    mid_o = torch.empty(cells, num_heads, per_cell, block_d, dtype=torch.float32, device=query.device)
    mid_lse = torch.empty(cells, num_heads, per_cell, dtype=torch.float32, device=query.device)
    paged_decode_kernel[grid](
        query, k_cache, v_cache, out, mid_o, mid_lse, seq_lens, block_tables, scale * math.log2(math.e),
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        mid_o.stride(0), mid_o.stride(1), mid_o.stride(2), mid_lse.stride(0), mid_lse.stride(1), base, splits,
        num_seqs, **common)
    # SLOTS: its rows in the decode grid's order (the slots follow it).
    rows_order = dict(order_ptr=order) if mode == decode_plan.SLOTS else {}
    reduce_splits_kernel[(num_seqs, num_heads)](
        mid_o, mid_lse, out, seq_lens, mid_o.stride(0), mid_o.stride(1), mid_o.stride(2),
        mid_lse.stride(0), mid_lse.stride(1), out.stride(0), out.stride(1), num_kv_heads, splits, base,
        HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_N=block_n, BLOCK_S=decode_plan.reduce_block(splits, mode),
        num_warps=4, **plan, **rows_order)
    return out


def longest_first(seq_lens: torch.Tensor) -> torch.Tensor:
    """Row indices by decreasing length: decode programs start in this order, so a long sequence's
    programs never start last and run on alone after the rest have finished."""
    return torch.argsort(seq_lens, descending=True)


def paged_prefill(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  query_start_loc: torch.Tensor, seq_lens: torch.Tensor, block_tables: torch.Tensor,
                  first_seq: int, num_seqs: int, max_query_len: int, scale: float, out: torch.Tensor,
                  block_m: int | None = None, block_n: int | None = None, num_warps: int | None = None,
                  num_stages: int | None = None, k_scale: torch.Tensor | None = None,
                  v_scale: torch.Tensor | None = None, gqa: bool | None = None,
                  lpt: bool | None = None, tma: bool | None = None, ws: bool | None = None,
                  window: int = 0, softcap: float = 0.0) -> torch.Tensor:
    """Causal varlen attention of sequences first_seq .. first_seq+num_seqs-1 over their paged context.

    query/out are the whole flat batch [num_tokens, num_heads, head_dim]; query_start_loc indexes it.
    block_m, block_n, num_warps, num_stages, gqa (the GQA-packed variant), lpt (longest tiles
    first), tma (K/V tiles by TMA, one page each), ws (its loop warp-specialised): None takes triton_prefill.prefill_launch()'s (Hopper's default at head_dim <= 128 and
    a 2-byte query: fp32's tiles take twice the shared memory, 262,656 bytes in 4 stages of 128 x 128
    against the H200's 232,448; PAGEDSERVE_PREFILL_LAUNCH). window > 0: a sliding window; softcap > 0:
    the scores soft-capped.
    """
    launch = prefill_launch(_sm90(query.device) and query.shape[-1] <= 128 and query.element_size() <= 2)
    given = {k: v for k, v in dict(block_m=block_m, block_n=block_n, num_warps=num_warps, num_stages=num_stages,
                                   gqa=gqa, lpt=lpt, tma=tma, ws=ws).items() if v is not None}
    if given:  # (tests and sweeps; serving takes the default, and every layer of a step calls this)
        launch = dataclasses.replace(launch, **given)
    return prefill_attention(query, k_cache, v_cache, query_start_loc, seq_lens, block_tables, first_seq, num_seqs,
                             max_query_len, scale, out, launch, _ieee(query, k_cache),
                             fp8_scale_args(k_cache, k_scale, v_scale), window, softcap)


def paged_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    meta: AttentionMetadata, scale: float, num_splits: int | None = None,
                    k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
                    out: torch.Tensor | None = None, window: int = 0, softcap: float = 0.0) -> torch.Tensor:
    """Causal attention of each sequence's new tokens over its whole paged context (see reference.py),
    into `out` when given (else a new tensor); an fp8 pool is read as stored * k_scale (v_scale),
    dequantized in the kernels' registers. window > 0: a sliding window (each token sees its last
    `window` positions, itself included); softcap > 0: scores soft-capped, cap * tanh(score / cap)
    (Gemma 2). Such layers never take the gathered long-prefill path (cuDNN's attention has
    neither; a window keeps the Triton kernels' work short anyway)."""
    num_heads, head_dim = query.shape[1], query.shape[2]
    num_kv_heads = k_cache.shape[2]
    check_pool_layout(k_cache, head_dim)
    if v_cache.stride() != k_cache.stride() or query.stride(2) != 1:
        raise ValueError("paged_attention needs K/V pools of one layout and contiguous head_dim in query")
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
    if meta.unified_capacity is not None:
        # Zeros: a graph bucket's padding rows belong to no sequence and are never written; they
        # must not carry NaNs from stale memory into the layers after (a MoE router reads them).
        out = torch.zeros_like(query) if out is None else out.zero_()
        return unified_paged_attention(query, k_cache, v_cache, meta, scale, out, k_scale=k_scale, v_scale=v_scale,
                                       window=window, softcap=softcap)
    out = torch.empty_like(query) if out is None else out
    nd, ns = meta.num_decodes, meta.num_seqs
    seq_lens_cpu = meta.seq_lens_cpu
    if nd > 0:
        max_len = max(seq_lens_cpu[:nd]) if seq_lens_cpu is not None else meta.max_seq_len
        if meta.decode_order is None and decode_plan.decode_launch_for(k_cache.dtype).longest_first:
            meta.decode_order = longest_first(meta.seq_lens[:nd])  # once per step: later layers reuse it
        # Outside a decode graph the grid follows the step's longest sequence and the switch's mode
        # applies as it is (its compiles are the warm-up's decode_compile_key).
        window_lens = meta.window_lens.get(window)
        if window > 0 and window_lens is None:  # once per step and window: later layers reuse it
            window_lens = meta.window_lens[window] = meta.seq_lens[:nd].clamp(max=window)
        paged_decode(query[:nd], k_cache, v_cache, meta.seq_lens[:nd], meta.block_tables[:nd],
                     max_len, scale, out[:nd], num_splits=num_splits, split_tokens=meta.decode_split_tokens,
                     order=meta.decode_order, k_scale=k_scale, v_scale=v_scale, window=window,
                     window_lens=window_lens, softcap=softcap)
    if nd < ns:
        q_lens = meta.query_lens_cpu
        gathered = gathered_prefill.active(k_cache.device)
        plain = window == 0 and softcap == 0
        long = gathered.chunks(meta, query, k_cache) if gathered is not None and plain else []
        for first, count in gathered_prefill_plan.other_ranges(nd, ns, long):
            max_q = max(q_lens[first:first + count]) if q_lens is not None else meta.max_query_len
            paged_prefill(query, k_cache, v_cache, meta.query_start_loc, meta.seq_lens, meta.block_tables,
                          first, count, max_q, scale, out, k_scale=k_scale, v_scale=v_scale, window=window,
                          softcap=softcap)
        for i in long:
            start, end = sum(q_lens[:i]), sum(q_lens[:i + 1])
            gathered.attend(query[start:end], k_cache, v_cache, meta.block_tables[i], meta.seq_lens_cpu[i], scale,
                            out=out[start:end], first_page=meta.page_runs.get(i) if meta.page_runs else None)
    return out


def unified_capacity(num_tokens: int, num_seqs: int, num_heads: int, num_kv_heads: int,
                     device: torch.device, block_m: int | None = None) -> tuple[int, int]:
    """The unified kernel's work capacity for steps of at most num_tokens tokens in num_seqs
    sequences (a full graph's bucket): AttentionMetadata.unified_capacity. block_m: default
    unified_launch()'s, as unified_paged_attention's."""
    launch = unified.unified_launch()
    block_q = unified.block_q_for(num_heads // num_kv_heads, launch.block_m if block_m is None else block_m)
    share, _ = decode_plan.balanced_share(device, launch.block_n)
    return unified.work_capacity(num_tokens, num_seqs, num_kv_heads, block_q, share)


def unified_paged_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            meta: AttentionMetadata, scale: float, out: torch.Tensor | None = None,
                            k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
                            block_m: int | None = None, block_n: int | None = None,
                            share_programs: int | None = None, min_chain_tiles: int | None = None,
                            num_warps: int | None = None, num_stages: int | None = None,
                            window: int = 0, softcap: float = 0.0) -> torch.Tensor:
    """Every sequence of the step (decodes and chunks alike) in one launch of the unified kernel
    (triton_unified.py), by a work list built on the device from the lengths, within
    meta.unified_capacity (default: sized for this step's tokens and sequences). The first layer of
    a step builds the list, later layers reuse it (meta.unified_work, one list per sliding window:
    window > 0, the layer's; the split buffers are shared). share_programs,
    min_chain_tiles: the split plan's even share (defaults as the decode kernel's balanced plan);
    block_m, block_n, num_warps, num_stages: None takes unified_launch()'s."""
    launch = unified.unified_launch()
    block_m = launch.block_m if block_m is None else block_m
    block_n = launch.block_n if block_n is None else block_n
    num_warps = launch.num_warps if num_warps is None else num_warps
    num_stages = launch.num_stages if num_stages is None else num_stages
    num_heads, head_dim = query.shape[1], query.shape[2]
    num_kv_heads = k_cache.shape[2]
    out = torch.empty_like(query) if out is None else out
    works = meta.unified_work = meta.unified_work or {}
    if window not in works:
        default_share, default_min_chain = decode_plan.balanced_share(query.device, block_n)
        share = default_share if share_programs is None else share_programs
        if meta.unified_capacity is not None and share > default_share:
            # The capacity's bound holds for the share it was sized with (unified_capacity's).
            raise ValueError(f"share_programs ({share}) must not exceed {default_share} with a fixed unified_capacity")
        min_chain = default_min_chain if min_chain_tiles is None else min_chain_tiles
        block_q = unified.block_q_for(num_heads // num_kv_heads, block_m)
        max_qtiles, capacity = meta.unified_capacity or unified.work_capacity(
            query.shape[0], meta.num_seqs, num_kv_heads, block_q, share)
        work = unified.build_work(meta.query_start_loc, meta.seq_lens, num_kv_heads, block_q, block_n,
                                  max_qtiles, capacity, share, min_chain, window=window)
        if works:  # another window's list, same capacity: its split buffers serve this one too
            mid = next(iter(works.values()))[1]
        else:
            block_m_rows = block_q * next_power_of_2(num_heads // num_kv_heads)
            mid = unified.mid_buffers(capacity, num_kv_heads, block_m_rows, _pow2_at_least_16(head_dim), query.device)
        works[window] = (work, mid)
    work, mid = works[window]
    return unified.unified_attention(query, k_cache, v_cache, meta.query_start_loc, meta.seq_lens,
                                     meta.block_tables, scale, out, work, _ieee(query, k_cache),
                                     fp8_scale_args(k_cache, k_scale, v_scale), num_warps, num_stages, mid, window,
                                     softcap)
