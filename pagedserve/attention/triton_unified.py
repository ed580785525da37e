"""Unified varlen paged attention: prefill chunks and decode rows of one step in one launch,
with a work list built on the device, so one CUDA graph per token-count bucket serves any mix.

The step's sequences are cut into query tiles of BLOCK_Q tokens (a decode row is one tile of one
token); a tile's rows are its tokens times the GQA group of one KV head (BLOCK_M = BLOCK_Q x
BLOCK_G rows, the M of tl.dot), and each tile reads its sequence's context up to its last token,
split along the context into KV splits when that helps (FlashAttention-3's scheduler metadata,
vLLM's unified attention):

  build_work (torch ops on the device, no host sync, fixed shapes): from query_start_loc and
  seq_lens, the q-tile list [max_qtiles] and the work list [capacity] of (sequence, q tile, KV
  start, KV end, splits of the tile). Splits follow triton_decode's "balanced" plan: the step's
  KV tiles times the KV heads are shared over share_programs programs, so no chain of tiles is
  longer than an even share (at least min_chain_tiles); one long sequence among short ones gets
  many splits, and a step of even lengths none. The lengths present decide, not max_model_len.

  Capacity (work_capacity), from host ints only: q tiles <= min(seqs, tokens) + tokens // BLOCK_Q
  (each non-empty sequence leaves at most one partial tile), and items = sum over tiles of
  ceil(tiles_t / chain) <= q tiles + share_programs / kv_heads, because chain >= all tiles x
  kv_heads / share_programs. So the buffers and the grid are sized by the token-count bucket and
  max_num_seqs alone; programs past the step's last item return at once.

  unified_attention_kernel, grid (item, KV head), items started last first (a causal chunk's
  longest tiles first, empty items past the step's end return at once): a tile with one split
  writes its rows' output;
  one with several writes (normalised output, log2-sum-exp) per split and reduce_tiles_kernel,
  grid (q tile, KV head), combines them. A split may start after some of a tile's rows (a later
  split of a chunk): those rows see nothing there (EMPTY_ROWS in the tile loop) and carry
  lse = -inf into the reduction.

A layer with a sliding window (WINDOW) gets work items that start at the tile holding their q
tile's earliest visible position (build_work's window), so the splits balance what is read.

Tokens outside every sequence (a graph bucket's padding) are not written.
"""
from __future__ import annotations

import functools
import math
import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from pagedserve.attention.tile_launch import TileLaunch, parse_tile_launch
from pagedserve.attention.triton_tiles import attend_causal
from pagedserve.host_math import next_power_of_2

# Fields of a work item and of a q tile (int32 rows of the work buffers).
ITEM_FIELDS = 5      # seq (-1: no work), q tile of the sequence, KV start, KV end, splits of the tile
QTILE_FIELDS = 4     # seq (-1: none), q tile of the sequence, first item, splits
UNIFIED_BLOCK_M = 64
UNIFIED_BLOCK_N = 64
MAX_SPLITS = 64
# An A/B of the launch without a code change (read once per process): '+'-joined bmN (rows of a
# tile: query tokens x padded GQA group), bnN (context positions per K/V tile), wN (warps), sN
# (pipeline stages), e.g. PAGEDSERVE_UNIFIED_LAUNCH=bm128+bn32+w8 (tile_launch.py's grammar, shared with
# PAGEDSERVE_PREFILL_LAUNCH). The H200 sweep (prefill_sweep.json, 3368ebd) picked bm256+bn64+w8+s3 on
# long chunks (0.83x the default's time); the default stays until a mixed-step A/B shows it suits the
# decode rows this kernel also serves (a 256-row tile holds 64 decode rows' worth of 4 heads each).
UNIFIED_LAUNCH_ENV = "PAGEDSERVE_UNIFIED_LAUNCH"


UNIFIED_DEFAULT = TileLaunch(block_m=UNIFIED_BLOCK_M, block_n=UNIFIED_BLOCK_N, num_warps=4, num_stages=2)


def parse_unified_launch(text: str) -> TileLaunch:
    return parse_tile_launch(text, UNIFIED_LAUNCH_ENV, UNIFIED_DEFAULT)


@functools.lru_cache(maxsize=None)
def unified_launch() -> TileLaunch:
    return parse_unified_launch(os.environ.get(UNIFIED_LAUNCH_ENV, ""))


@dataclass
class UnifiedWork:
    items: torch.Tensor      # [capacity, ITEM_FIELDS] int32
    qtiles: torch.Tensor     # [max_qtiles, QTILE_FIELDS] int32
    block_q: int
    block_n: int


def block_q_for(group: int, block_m: int = UNIFIED_BLOCK_M) -> int:
    """Query tokens per tile: block_m rows over the GQA group padded to a power of two."""
    return max(1, block_m // next_power_of_2(group))


def work_capacity(num_tokens: int, num_seqs: int, num_kv_heads: int, block_q: int,
                  share_programs: int) -> tuple[int, int]:
    """(max q tiles, max work items) of any step of at most num_tokens tokens in num_seqs
    sequences (see the module docstring for the bound)."""
    max_qtiles = min(num_seqs, num_tokens) + num_tokens // block_q
    return max(1, max_qtiles), max(1, max_qtiles + -(-share_programs // num_kv_heads))


def build_work(query_start_loc: torch.Tensor, seq_lens: torch.Tensor, num_kv_heads: int, block_q: int,
               block_n: int, max_qtiles: int, capacity: int, share_programs: int, min_chain_tiles: int,
               max_splits: int = MAX_SPLITS, window: int = 0) -> UnifiedWork:
    """The step's q tiles and work items, from its lengths on the device (no sync; every shape
    depends only on the arguments' shapes and the host ints). window > 0: a sliding window's
    layers, whose tiles read from the tile holding their first row's earliest visible position."""
    device = seq_lens.device
    qsl = query_start_loc.long()
    q_lens = qsl[1:] - qsl[:-1]
    s_lens = seq_lens.long()
    num_seqs = s_lens.shape[0]
    tiles = (q_lens + block_q - 1) // block_q
    cum = tiles.cumsum(0)
    j = torch.arange(max_qtiles, device=device)
    seq = torch.searchsorted(cum, j, right=True)
    valid = j < cum[-1]
    seq_c = seq.clamp(max=num_seqs - 1)
    tile = j - (cum[seq_c] - tiles[seq_c])
    q_len = q_lens[seq_c]
    kv_len = s_lens[seq_c] - q_len + torch.minimum((tile + 1) * block_q, q_len)
    kv_lo = torch.zeros_like(kv_len)
    if window > 0:
        kv_lo = (s_lens[seq_c] - q_len + tile * block_q - window + 1).clamp(min=0) // block_n * block_n
    kv_tiles = torch.where(valid, (kv_len - kv_lo + block_n - 1) // block_n, 0)
    # The balanced plan: no chain longer than an even share of the step (at least min_chain_tiles).
    chain = ((kv_tiles.sum() * num_kv_heads + share_programs - 1) // share_programs).clamp(min=min_chain_tiles)
    parts = ((kv_tiles + chain - 1) // chain).clamp(1, max_splits)
    split_tiles = ((kv_tiles + parts - 1) // parts).clamp(min=1)
    nsplits = torch.where(valid, (kv_tiles + split_tiles - 1) // split_tiles, 0)  # no empty split
    cum2 = nsplits.cumsum(0)
    i = torch.arange(capacity, device=device)
    qt = torch.searchsorted(cum2, i, right=True).clamp(max=max_qtiles - 1)
    item_valid = i < cum2[-1]
    split = i - (cum2[qt] - nsplits[qt])
    start = kv_lo[qt] + split * split_tiles[qt] * block_n
    end = torch.minimum(start + split_tiles[qt] * block_n, kv_len[qt])
    items = torch.stack([torch.where(item_valid, seq_c[qt], -1), tile[qt], start, end, nsplits[qt]], 1)
    qtiles = torch.stack([torch.where(valid, seq_c, -1), tile, cum2 - nsplits, nsplits], 1)
    return UnifiedWork(items.to(torch.int32), qtiles.to(torch.int32), block_q, block_n)


@triton.jit(do_not_specialize=["stride_qt", "stride_ot", "stride_bt"])
def unified_attention_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, mid_o_ptr, mid_lse_ptr,
    items_ptr, query_start_loc_ptr, seq_lens_ptr, block_tables_ptr, qk_scale,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_cb, stride_cs, stride_ch, stride_bt,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_Q: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr,
    k_scale_ptr=None, v_scale_ptr=None, KV_FP8: tl.constexpr = False, KV_SCALE_PER_HEAD: tl.constexpr = False,
    WINDOW: tl.constexpr = 0, SOFTCAP: tl.constexpr = 0.0,
):
    # Items in reverse: a chunk's last tiles (its longest chains: causal) and the step's last
    # sequences start first, the empty items past the step's last one return at once.
    item = tl.num_programs(0) - 1 - tl.program_id(0)
    kv_head = tl.program_id(1)
    num_kv_heads = tl.num_programs(1)
    base = items_ptr + item * 5
    seq = tl.load(base)
    if seq < 0:
        return
    tile = tl.load(base + 1)
    kv_start = tl.load(base + 2)
    kv_end = tl.load(base + 3)
    nsplits = tl.load(base + 4)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    ctx_before = tl.load(seq_lens_ptr + seq) - q_len

    BLOCK_M: tl.constexpr = BLOCK_Q * BLOCK_G
    r = tl.arange(0, BLOCK_M)
    tok = tile * BLOCK_Q + r // BLOCK_G
    g = r % BLOCK_G
    row_valid = (tok < q_len) & (g < GROUP)
    heads = kv_head * GROUP + g
    d = tl.arange(0, BLOCK_D)
    if BLOCK_D == HEAD_DIM:
        q_mask = row_valid[:, None]
    else:
        q_mask = row_valid[:, None] & (d[None, :] < HEAD_DIM)
    rows = (q_start + tok).to(tl.int64)
    q = tl.load(q_ptr + rows[:, None] * stride_qt + heads[:, None] * stride_qh + d[None, :], mask=q_mask, other=0.0)
    if IEEE:
        q = q.to(tl.float32)
    elif not KV_FP8:
        q = q.to(k_cache_ptr.dtype.element_ty)
    if KV_FP8:
        if KV_SCALE_PER_HEAD:  # [num_kv_heads] scales: this program's KV head's
            qk_scale = qk_scale * tl.load(k_scale_ptr + kv_head)
        else:
            qk_scale = qk_scale * tl.load(k_scale_ptr)  # dequantizing K is one multiply per score
    q_pos = ctx_before + tok

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.full([BLOCK_M], 0.0, tl.float32)
    acc = tl.full([BLOCK_M, BLOCK_D], 0.0, tl.float32)
    table = block_tables_ptr + seq.to(tl.int64) * stride_bt
    head_off = kv_head * stride_ch
    # Whole tiles below the tile's first query position are visible to every row: no mask (with a
    # sliding window, which build_work started the items at, every tile is masked by it).
    first_pos = ctx_before + tile * BLOCK_Q
    unmasked_end = tl.minimum((first_pos + 1) // BLOCK_N * BLOCK_N, kv_end // BLOCK_N * BLOCK_N)
    unmasked_end = tl.maximum(unmasked_end, kv_start)
    acc, l_i, m_i = attend_causal(acc, l_i, m_i, q, q_pos, kv_start, unmasked_end, kv_end,
                                  k_cache_ptr, v_cache_ptr, table, head_off, qk_scale, stride_cb, stride_cs, d,
                                  HEAD_DIM, BLOCK_SIZE, BLOCK_D, BLOCK_N, IEEE, KV_FP8, True, WINDOW, SOFTCAP)
    seen = l_i > 0
    out = acc / tl.where(seen, l_i, 1.0)[:, None]
    if KV_FP8:
        if KV_SCALE_PER_HEAD:
            out = out * tl.load(v_scale_ptr + kv_head)
        else:
            out = out * tl.load(v_scale_ptr)  # V's scale, once per output (the reduction is linear in it)
    if nsplits == 1:
        tl.store(out_ptr + rows[:, None] * stride_ot + heads[:, None] * stride_oh + d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=q_mask)
    else:
        mid = (item * num_kv_heads + kv_head).to(tl.int64) * BLOCK_M + r
        tl.store(mid_o_ptr + mid[:, None] * BLOCK_D + d[None, :], out)
        tl.store(mid_lse_ptr + mid, tl.where(seen, m_i + tl.log2(tl.where(seen, l_i, 1.0)), float("-inf")))


@triton.jit(do_not_specialize=["stride_ot"])
def reduce_tiles_kernel(
    mid_o_ptr, mid_lse_ptr, out_ptr, qtiles_ptr, query_start_loc_ptr, stride_ot, stride_oh,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_G: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """Program (q tile, KV head): out = sum_s 2^(lse_s - lse) o_s over the tile's splits."""
    qtile = tl.program_id(0)
    kv_head = tl.program_id(1)
    num_kv_heads = tl.num_programs(1)
    base = qtiles_ptr + qtile * 4
    seq = tl.load(base)
    nsplits = tl.load(base + 3)
    if (seq < 0) | (nsplits < 2):
        return
    tile = tl.load(base + 1)
    first = tl.load(base + 2)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    BLOCK_M: tl.constexpr = BLOCK_Q * BLOCK_G
    r = tl.arange(0, BLOCK_M)
    d = tl.arange(0, BLOCK_D)
    tok = tile * BLOCK_Q + r // BLOCK_G
    g = r % BLOCK_G
    row_valid = (tok < q_len) & (g < GROUP)
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    w = tl.full([BLOCK_M], 0.0, tl.float32)
    acc = tl.full([BLOCK_M, BLOCK_D], 0.0, tl.float32)
    for s in range(0, nsplits):
        mid = ((first + s) * num_kv_heads + kv_head).to(tl.int64) * BLOCK_M + r
        lse = tl.load(mid_lse_ptr + mid)
        o = tl.load(mid_o_ptr + mid[:, None] * BLOCK_D + d[None, :])
        m_new = tl.maximum(m, lse)
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m - m_use)
        beta = tl.exp2(lse - m_use)
        acc = acc * alpha[:, None] + o * beta[:, None]
        w = w * alpha + beta
        m = m_new
    out = acc / tl.where(w > 0, w, 1.0)[:, None]
    rows = (q_start + tok).to(tl.int64)
    heads = kv_head * GROUP + g
    tl.store(out_ptr + rows[:, None] * stride_ot + heads[:, None] * stride_oh + d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=row_valid[:, None] & (d[None, :] < HEAD_DIM))


def mid_buffers(capacity: int, num_kv_heads: int, block_m: int, block_d: int,
                device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-split partial outputs and log2-sum-exps, one [BLOCK_M] tile per (item, KV head)."""
    return (torch.empty(capacity, num_kv_heads, block_m, block_d, dtype=torch.float32, device=device),
            torch.empty(capacity, num_kv_heads, block_m, dtype=torch.float32, device=device))


def unified_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      query_start_loc: torch.Tensor, seq_lens: torch.Tensor, block_tables: torch.Tensor,
                      scale: float, out: torch.Tensor, work: UnifiedWork, ieee: bool,
                      scales: dict | None = None, num_warps: int = 4, num_stages: int = 2,
                      mid: tuple[torch.Tensor, torch.Tensor] | None = None, window: int = 0,
                      softcap: float = 0.0) -> torch.Tensor:
    """Attention of every sequence's new tokens (query/out [num_tokens, H, D], rows indexed by
    query_start_loc) over its paged context, by the work list `work` (build_work, for the same
    sliding window: window > 0); softcap > 0: the scores soft-capped (Gemma 2)."""
    num_heads, head_dim = query.shape[1], query.shape[2]
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    block_g = next_power_of_2(group)
    block_m = work.block_q * block_g
    block_d = max(16, next_power_of_2(head_dim))
    capacity, max_qtiles = work.items.shape[0], work.qtiles.shape[0]
    if mid is None:
        mid = mid_buffers(capacity, num_kv_heads, block_m, block_d, query.device)
    mid_o, mid_lse = mid
    common = dict(GROUP=group, HEAD_DIM=head_dim, BLOCK_Q=work.block_q, BLOCK_G=block_g, BLOCK_D=block_d)
    unified_attention_kernel[(capacity, num_kv_heads)](
        query, k_cache, v_cache, out, mid_o, mid_lse, work.items, query_start_loc, seq_lens, block_tables,
        scale * math.log2(math.e),
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        BLOCK_SIZE=k_cache.shape[1], BLOCK_N=work.block_n, IEEE=ieee, num_warps=num_warps,
        num_stages=num_stages, **common, **(scales or {}),
        **{k: v for k, v in dict(WINDOW=window, SOFTCAP=float(softcap)).items() if v})
    reduce_tiles_kernel[(max_qtiles, num_kv_heads)](
        mid_o, mid_lse, out, work.qtiles, query_start_loc, out.stride(0), out.stride(1), num_warps=4, **common)
    return out
