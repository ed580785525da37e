"""Paged prefill/extend attention in Triton: varlen causal attention over a paged context.

Grid (query tile, sequence, query head). Sequence i's q new tokens sit at positions
L - q .. L - 1 of its context of L tokens; they attend to every cached token and causally
to each other. K/V are read only through the block table by triton_tiles.attend_tiles, the
loop the decode kernel shares. Tiles wholly below the tile's first query position need no
causal mask; only the tiles on the diagonal pay for one.
"""
import triton
import triton.language as tl

from pagedserve.attention.triton_tiles import CAUSAL, NO_MASK, attend_tiles


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
):
    tile_m = tl.program_id(0)
    seq = tl.program_id(1) + first_seq
    head = tl.program_id(2)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    if tile_m * BLOCK_M >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    ctx_before = seq_len - q_len

    m = tile_m * BLOCK_M + tl.arange(0, BLOCK_M)
    d = tl.arange(0, BLOCK_D)
    m_valid = m < q_len
    if BLOCK_D == HEAD_DIM:
        q_mask = m_valid[:, None]
    else:
        q_mask = m_valid[:, None] & (d[None, :] < HEAD_DIM)
    rows = (q_start + m).to(tl.int64)
    q = tl.load(q_ptr + rows[:, None] * stride_qt + head * stride_qh + d[None, :], mask=q_mask, other=0.0)
    if IEEE:
        q = q.to(tl.float32)
    elif not KV_FP8:
        q = q.to(k_cache_ptr.dtype.element_ty)
    if KV_FP8:
        if KV_SCALE_PER_HEAD:  # [num_kv_heads] scales: this query head's KV head's
            qk_scale = qk_scale * tl.load(k_scale_ptr + head // GROUP)
        else:
            qk_scale = qk_scale * tl.load(k_scale_ptr)  # dequantizing K is one multiply per score
    q_pos = ctx_before + m

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.full([BLOCK_M], 0.0, tl.float32)
    acc = tl.full([BLOCK_M, BLOCK_D], 0.0, tl.float32)
    table = block_tables_ptr + seq.to(tl.int64) * stride_bt
    head_off = (head // GROUP) * stride_ch
    # Keys below the tile's first query position are visible to every row: no mask.
    unmasked_end = ((ctx_before + tile_m * BLOCK_M + 1) // BLOCK_N) * BLOCK_N
    causal_end = tl.minimum(ctx_before + (tile_m + 1) * BLOCK_M, seq_len)
    acc, l_i, m_i = attend_tiles(acc, l_i, m_i, q, q_pos, 0, unmasked_end,
                                 k_cache_ptr, v_cache_ptr, table, head_off, qk_scale,
                                 stride_cb, stride_cs, d,
                                 HEAD_DIM, BLOCK_SIZE, BLOCK_D, BLOCK_N, NO_MASK, IEEE, KV_FP8)
    acc, l_i, m_i = attend_tiles(acc, l_i, m_i, q, q_pos, unmasked_end, causal_end,
                                 k_cache_ptr, v_cache_ptr, table, head_off, qk_scale,
                                 stride_cb, stride_cs, d,
                                 HEAD_DIM, BLOCK_SIZE, BLOCK_D, BLOCK_N, CAUSAL, IEEE, KV_FP8)
    out = acc / l_i[:, None]
    if KV_FP8:
        if KV_SCALE_PER_HEAD:
            out = out * tl.load(v_scale_ptr + head // GROUP)
        else:
            out = out * tl.load(v_scale_ptr)
    tl.store(out_ptr + rows[:, None] * stride_ot + head * stride_oh + d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=q_mask)
