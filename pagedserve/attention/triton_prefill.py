"""Paged prefill/extend attention in Triton: varlen causal attention over a paged context.

Grid (query tile, sequence, query head). Sequence i's q new tokens sit at positions
L - q .. L - 1 of its context of L tokens; they attend to every cached token and causally
to each other. K/V are read only through the block table by triton_tiles.attend_tiles, the
loop the decode kernel shares. Tiles wholly below the tile's first query position need no
causal mask; only the tiles on the diagonal pay for one.

GQA (the packed variant, a constexpr): grid (query tile, sequence, KV head) and a tile's BLOCK_M
rows are BLOCK_M / BLOCK_G query tokens times the GQA group padded to BLOCK_G (token-major, as the
unified kernel's), so each K/V tile is loaded once per group instead of once per query head, and
a tile's dots do GROUP times the arithmetic per byte of K/V. Each row's causal mask uses its own
token's position. Without it every K/V tile is read by GROUP programs (through L2 at best).

TMA (tma, a constexpr; WS: ws): where a page holds whole K/V tiles (block size a multiple of bn),
each tile is one TMA load of a descriptor over the pool (triton_tiles.attend_tiles_tma) instead
of BLOCK_N row gathers through the block table, and the tile loop may be warp-specialised (ws),
the shape of FlashAttention-3's producer/consumer split that Triton builds on Hopper from
descriptor loads. Serving needs --block-size a multiple of bn (e.g. 128) for it. On the H200 tma takes
~0.93x the gather launch's time at long chunks, ws adds nothing, and bn64+w4+gqa+tma+ws fails to
compile (docs/long-context.md).

WINDOW (a constexpr, 0: none): a sliding-window layer's rows see only their last WINDOW positions;
its tiles start at the first row's earliest one and all take the windowed mask. SOFTCAP (0: none):
Gemma 2's soft-capped scores.

LONGEST_FIRST (lpt, a constexpr): query tiles start in reverse, so a chunk's last tiles, the
longest (causal), start first and the short ones fill the end of the grid instead of leaving one
long program running alone (the unified kernel orders its items so too).

The launch (BLOCK_M, BLOCK_N, warps, stages, GQA) comes from prefill_launch(): PREFILL_DEFAULT
(PREFILL_DEFAULT_SM90 on Hopper), or PAGEDSERVE_PREFILL_LAUNCH in tile_launch.py's grammar (bm128+bn64+w8+s3+gqa);
benchmarks/kernels/prefill_sweep.py times the candidates at long-context shapes.
"""
import functools
import math
import os

import triton
import triton.language as tl

from pagedserve.attention.tile_launch import TileLaunch, parse_tile_launch
from pagedserve.attention.triton_tiles import CAUSAL, NO_MASK, attend_causal, attend_tiles_tma
from pagedserve.host_math import cdiv, next_power_of_2

PREFILL_BLOCK_M = 64
PREFILL_BLOCK_N = 64
PREFILL_DEFAULT = TileLaunch(block_m=PREFILL_BLOCK_M, block_n=PREFILL_BLOCK_N, num_warps=4, num_stages=2)
# Hopper (sm90), head_dim <= 128: the H200 sweep's pick (benchmarks/results/h200/prefill_sweep.json,
# 3368ebd): 0.84-0.92x the default's time at every long shape swept (8k x 8k to 8k x 100k, 2k x 64k),
# ~410-440 TFLOPS at 32k-100k. Its 128x128 tiles in 4 stages need Hopper's shared memory (an A100's
# 164 KB may not hold them) and were swept at head_dim 128 in bf16 only; elsewhere (an fp32 query's
# tiles need 262,656 bytes: the H200's GPU tests ran out of shared memory) the small default stays.
PREFILL_DEFAULT_SM90 = TileLaunch(block_m=128, block_n=128, num_warps=8, num_stages=4)
# An A/B of the launch without a code change (read once per process), e.g.
# PAGEDSERVE_PREFILL_LAUNCH=bm128+bn64+w8+s3+gqa+lpt: its parts change the default above.
PREFILL_LAUNCH_ENV = "PAGEDSERVE_PREFILL_LAUNCH"
PREFILL_FLAGS = ("gqa", "lpt", "tma", "ws")


def parse_prefill_launch(text: str, sm90: bool = False) -> TileLaunch:
    return parse_tile_launch(text, PREFILL_LAUNCH_ENV, PREFILL_DEFAULT_SM90 if sm90 else PREFILL_DEFAULT,
                             PREFILL_FLAGS)


@functools.lru_cache(maxsize=None)
def prefill_launch(sm90: bool = False) -> TileLaunch:
    """paged_prefill's launch: the default (PREFILL_DEFAULT_SM90 where sm90: a Hopper GPU and
    head_dim <= 128), or as PREFILL_LAUNCH_ENV changes it."""
    return parse_prefill_launch(os.environ.get(PREFILL_LAUNCH_ENV, ""), sm90)


def prefill_rows(group: int, launch: TileLaunch) -> tuple[int, int, bool]:
    """(BLOCK_G, query tokens per tile, packed) of a launch over a GQA group of `group`: packed
    only with gqa and a group above 1 (for MHA the two variants are the same kernel)."""
    if not launch.gqa or group == 1:
        return 1, launch.block_m, False
    block_g = next_power_of_2(group)
    if block_g > launch.block_m:
        raise ValueError(f"{PREFILL_LAUNCH_ENV}: gqa needs bmN >= the padded GQA group ({block_g}), got {launch.block_m}")
    return block_g, launch.block_m // block_g, True


# The decode count (first_seq), the block-table width and the query's row stride (eager qkv view or
# a piecewise graph's buffer) change: one compile serves all.
@triton.jit(do_not_specialize=["first_seq", "stride_bt", "stride_qt", "stride_ot"])
def paged_prefill_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr,
    query_start_loc_ptr, seq_lens_ptr, block_tables_ptr, first_seq, qk_scale,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_cb, stride_cs, stride_ch, stride_bt,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr,
    k_scale_ptr=None, v_scale_ptr=None, KV_FP8: tl.constexpr = False, KV_SCALE_PER_HEAD: tl.constexpr = False,
    GQA: tl.constexpr = False, BLOCK_G: tl.constexpr = 1, LONGEST_FIRST: tl.constexpr = False,
    k_desc=None, v_desc=None, TMA: tl.constexpr = False, WS: tl.constexpr = False, WINDOW: tl.constexpr = 0,
    SOFTCAP: tl.constexpr = 0.0,
):
    # BLOCK_Q query tokens per tile: all BLOCK_M rows, or with GQA BLOCK_M / BLOCK_G tokens x heads.
    BLOCK_Q: tl.constexpr = BLOCK_M // BLOCK_G
    if LONGEST_FIRST:
        tile_m = tl.num_programs(0) - 1 - tl.program_id(0)
    else:
        tile_m = tl.program_id(0)
    seq = tl.program_id(1) + first_seq
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    if tile_m * BLOCK_Q >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    ctx_before = seq_len - q_len

    d = tl.arange(0, BLOCK_D)
    if GQA:
        kv_head = tl.program_id(2)
        r = tl.arange(0, BLOCK_M)
        m = tile_m * BLOCK_Q + r // BLOCK_G  # each row's token in the chunk
        g = r % BLOCK_G
        m_valid = (m < q_len) & (g < GROUP)
        q_head_off = (kv_head * GROUP + g)[:, None] * stride_qh
        o_head_off = (kv_head * GROUP + g)[:, None] * stride_oh
    else:
        head = tl.program_id(2)
        kv_head = head // GROUP
        m = tile_m * BLOCK_M + tl.arange(0, BLOCK_M)
        m_valid = m < q_len
        q_head_off = head * stride_qh
        o_head_off = head * stride_oh
    if BLOCK_D == HEAD_DIM:
        q_mask = m_valid[:, None]
    else:
        q_mask = m_valid[:, None] & (d[None, :] < HEAD_DIM)
    rows = (q_start + m).to(tl.int64)
    q = tl.load(q_ptr + rows[:, None] * stride_qt + q_head_off + d[None, :], mask=q_mask, other=0.0)
    if IEEE:
        q = q.to(tl.float32)
    elif not KV_FP8:
        q = q.to(k_cache_ptr.dtype.element_ty)
    if KV_FP8:
        if KV_SCALE_PER_HEAD:  # [num_kv_heads] scales: this query head's KV head's
            qk_scale = qk_scale * tl.load(k_scale_ptr + kv_head)
        else:
            qk_scale = qk_scale * tl.load(k_scale_ptr)  # dequantizing K is one multiply per score
    q_pos = ctx_before + m

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.full([BLOCK_M], 0.0, tl.float32)
    acc = tl.full([BLOCK_M, BLOCK_D], 0.0, tl.float32)
    table = block_tables_ptr + seq.to(tl.int64) * stride_bt
    head_off = kv_head * stride_ch
    # Keys below the tile's first query position are visible to every row: no mask.
    unmasked_end = ((ctx_before + tile_m * BLOCK_Q + 1) // BLOCK_N) * BLOCK_N
    causal_end = tl.minimum(ctx_before + (tile_m + 1) * BLOCK_Q, seq_len)
    if TMA:
        kv_col = kv_head * HEAD_DIM
        acc, l_i, m_i = attend_tiles_tma(acc, l_i, m_i, q, q_pos, 0, unmasked_end, k_desc, v_desc, table, kv_col,
                                         qk_scale, BLOCK_SIZE, BLOCK_N, NO_MASK, IEEE, WS)
        acc, l_i, m_i = attend_tiles_tma(acc, l_i, m_i, q, q_pos, unmasked_end, causal_end, k_desc, v_desc, table,
                                         kv_col, qk_scale, BLOCK_SIZE, BLOCK_N, CAUSAL, IEEE, WS)
    else:
        # A sliding window: from the tile holding the first row's earliest visible position.
        lo = tl.maximum(ctx_before + tile_m * BLOCK_Q - WINDOW + 1, 0) // BLOCK_N * BLOCK_N if WINDOW > 0 else 0
        acc, l_i, m_i = attend_causal(acc, l_i, m_i, q, q_pos, lo, unmasked_end, causal_end,
                                      k_cache_ptr, v_cache_ptr, table, head_off, qk_scale, stride_cb, stride_cs, d,
                                      HEAD_DIM, BLOCK_SIZE, BLOCK_D, BLOCK_N, IEEE, KV_FP8, False, WINDOW, SOFTCAP)
    # Padded group rows (g >= GROUP) saw every position with q = 0: l_i > 0, no NaN; not stored.
    out = acc / l_i[:, None]
    if KV_FP8:
        if KV_SCALE_PER_HEAD:
            out = out * tl.load(v_scale_ptr + kv_head)
        else:
            out = out * tl.load(v_scale_ptr)
    tl.store(out_ptr + rows[:, None] * stride_ot + o_head_off + d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=q_mask)


def tma_descriptors(k_cache, v_cache, launch: TileLaunch, head_dim: int, scales: dict) -> dict:
    """The tma launch's K/V descriptors: each pool as a [blocks * block_size, kv heads * head_dim]
    matrix of [bn, head_dim] tiles. A pool it cannot serve is a ValueError naming the switch."""
    from triton.tools.tensor_descriptor import TensorDescriptor
    num_blocks, block_size, num_kv_heads = k_cache.shape[:3]
    why = None
    if block_size % launch.block_n:
        why = f"the block size ({block_size}) must be a multiple of bn ({launch.block_n}): a tile is one page"
    elif scales or k_cache.element_size() == 1:
        why = "an fp8 KV cache takes the gather path (its scales)"
    elif head_dim & (head_dim - 1) or head_dim < 16:
        why = f"head_dim must be a power of two >= 16, got {head_dim}"
    elif not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        why = "the K/V pools must be contiguous"
    if why:
        raise ValueError(f"{PREFILL_LAUNCH_ENV}: tma: {why}")
    rows, cols = num_blocks * block_size, num_kv_heads * head_dim
    return {name: TensorDescriptor.from_tensor(pool.view(rows, cols), [launch.block_n, head_dim])
            for name, pool in (("k_desc", k_cache), ("v_desc", v_cache))}


def prefill_attention(query, k_cache, v_cache, query_start_loc, seq_lens, block_tables, first_seq: int,
                      num_seqs: int, max_query_len: int, scale: float, out, launch: TileLaunch, ieee: bool,
                      scales: dict, window: int = 0, softcap: float = 0.0):
    """paged_prefill_kernel's launch (triton_ops.paged_prefill's body): ieee and scales as
    triton_ops computes them for every kernel; window > 0: the layer's sliding window, softcap > 0
    its scores' soft cap (both the gather loop's: tma is refused)."""
    num_heads, head_dim = query.shape[1], query.shape[2]
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    block_g, block_q, packed = prefill_rows(group, launch)
    # Only when asked for, so that the default launch stays the compiled variant it was before the switch.
    pack = dict(GQA=True, BLOCK_G=block_g) if packed else {}
    if launch.lpt:
        pack["LONGEST_FIRST"] = True
    if window > 0 or softcap > 0:
        if launch.tma:
            raise ValueError(f"{PREFILL_LAUNCH_ENV}: tma: a sliding-window or soft-capped layer takes the gather loop")
        pack.update({k: v for k, v in dict(WINDOW=window, SOFTCAP=float(softcap)).items() if v})
    if launch.tma:
        pack.update(tma_descriptors(k_cache, v_cache, launch, head_dim, scales), TMA=True, WS=launch.ws)
    elif launch.ws:
        raise ValueError(f"{PREFILL_LAUNCH_ENV}: ws warp-specialises the tma loop; add tma")
    grid = (cdiv(max_query_len, block_q), num_seqs, num_kv_heads if packed else num_heads)
    paged_prefill_kernel[grid](
        query, k_cache, v_cache, out, query_start_loc, seq_lens, block_tables, first_seq,
        scale * math.log2(math.e),
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        GROUP=group, HEAD_DIM=head_dim, BLOCK_SIZE=k_cache.shape[1], BLOCK_M=launch.block_m,
        BLOCK_D=max(16, next_power_of_2(head_dim)), BLOCK_N=launch.block_n, IEEE=ieee,
        num_warps=launch.num_warps, num_stages=launch.num_stages, **pack, **scales)
    return out
