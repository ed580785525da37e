"""The inner loop both paged attention kernels share: walk K/V tiles through a block table and
fold them into an online softmax.

A tile is BLOCK_N consecutive context positions gathered token by token through the sequence's
block table (so any block size works, 1 included). The softmax runs in fp32 with exp2 on scores
pre-scaled by log2(e) (qk_scale); (acc, l_i, m_i) are the running weighted sum, normaliser and
row maximum, and the caller divides acc by l_i at the end.
"""
import triton
import triton.language as tl

# MASK: which scores a tile keeps. Tiles known to lie wholly inside the context and below every
# query row (prefill's un-masked stretch) need no mask at all.
NO_MASK: tl.constexpr = tl.constexpr(0)
IN_CONTEXT: tl.constexpr = tl.constexpr(1)   # positions < hi (decode: the whole split)
CAUSAL: tl.constexpr = tl.constexpr(2)       # positions < hi and <= the query row's position
# CAUSAL and within the row's sliding window: position > the row's position - WINDOW (HF's
# sliding-window mask: a row sees itself and the WINDOW - 1 positions before it).
WINDOWED: tl.constexpr = tl.constexpr(3)
LOG2E: tl.constexpr = tl.constexpr(1.4426950408889634)


@triton.jit
def softcap(s, SOFTCAP: tl.constexpr):
    """Gemma 2's soft-capped scores, cap * tanh(x / cap), on scores s already scaled by log2(e)
    (x = s / log2(e)); tanh(y) = 1 - 2 / (e^2y + 1), which saturates to +-1 without NaNs."""
    y2 = s * (2.0 / SOFTCAP)  # 2y in log2 units: e^2y = 2^(2y log2 e) = 2^(s * 2 / cap)
    return (1.0 - 2.0 / (tl.exp2(y2) + 1.0)) * (SOFTCAP * LOG2E)


@triton.jit
def fold_tile(acc, l_i, m_i, s, v, IEEE: tl.constexpr, EMPTY_ROWS: tl.constexpr = False):
    """One tile's scaled scores s ([rows, BLOCK_N], -inf where masked) and values v folded into the
    online softmax (acc, l_i, m_i). EMPTY_ROWS: see attend_tiles."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    if EMPTY_ROWS:
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_use)
        p = tl.exp2(s - m_use[:, None])
    else:
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    if IEEE:
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
    else:
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return acc, l_i, m_new


@triton.jit
def attend_tiles(
    acc, l_i, m_i, q, q_pos, lo, hi,
    k_cache_ptr, v_cache_ptr, table, head_off, qk_scale,
    stride_cb, stride_cs, d,
    HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr, MASK: tl.constexpr, IEEE: tl.constexpr, KV_FP8: tl.constexpr = False,
    EMPTY_ROWS: tl.constexpr = False, WINDOW: tl.constexpr = 0, SOFTCAP: tl.constexpr = 0.0,
):
    """Context positions [lo, hi) for query rows q ([rows, BLOCK_D], already in the dot's dtype:
    fp32 when IEEE, else the cache's, or for an fp8 cache the query's own or fp16 (the decode's
    F16_DOT)) at positions q_pos (read only when MASK is CAUSAL or WINDOWED; WINDOW: the
    sliding window of WINDOWED; SOFTCAP > 0: scores soft-capped, Gemma 2's). KV_FP8: the tiles are e4m3 and are cast to q's dtype here,
    in registers; their scales are the caller's (folded into qk_scale and the output).
    EMPTY_ROWS: a row may see no position of a tile, nor of any before it (a KV split that
    starts after the row's position): its maximum stays -inf and must not make NaNs."""
    n = tl.arange(0, BLOCK_N)
    for tile in range(lo, hi, BLOCK_N):
        pos = tile + n
        valid = pos < hi
        block = tl.load(table + pos // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
        kv_off = block * stride_cb + (pos % BLOCK_SIZE) * stride_cs + head_off
        if BLOCK_D == HEAD_DIM:
            kv_mask = valid[:, None]
        else:
            kv_mask = valid[:, None] & (d[None, :] < HEAD_DIM)
        k = tl.load(k_cache_ptr + kv_off[:, None] + d[None, :], mask=kv_mask, other=0.0)
        v = tl.load(v_cache_ptr + kv_off[:, None] + d[None, :], mask=kv_mask, other=0.0)
        if KV_FP8:
            k = k.to(q.dtype)
            v = v.to(q.dtype)
        if IEEE:
            s = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        s = s * qk_scale
        if SOFTCAP > 0:
            s = softcap(s, SOFTCAP)
        if MASK == IN_CONTEXT:
            s = tl.where(valid[None, :], s, float("-inf"))
        elif MASK == CAUSAL:
            s = tl.where(valid[None, :] & (pos[None, :] <= q_pos[:, None]), s, float("-inf"))
        elif MASK == WINDOWED:
            seen = (pos[None, :] <= q_pos[:, None]) & (pos[None, :] > q_pos[:, None] - WINDOW)
            s = tl.where(valid[None, :] & seen, s, float("-inf"))
        acc, l_i, m_i = fold_tile(acc, l_i, m_i, s, v, IEEE, EMPTY_ROWS)
    return acc, l_i, m_i


@triton.jit
def attend_causal(
    acc, l_i, m_i, q, q_pos, lo, unmasked_end, hi,
    k_cache_ptr, v_cache_ptr, table, head_off, qk_scale,
    stride_cb, stride_cs, d,
    HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr, IEEE: tl.constexpr, KV_FP8: tl.constexpr, EMPTY_ROWS: tl.constexpr,
    WINDOW: tl.constexpr, SOFTCAP: tl.constexpr,
):
    """Causal attention of query rows over positions [lo, hi), as the prefill and unified kernels
    walk it: [lo, unmasked_end) (tiles below every row's position) without a mask, the rest
    CAUSAL (EMPTY_ROWS: rows that may see none of it); with a sliding window (WINDOW > 0) every
    tile WINDOWED, rows that see none of the first tiles included."""
    if WINDOW > 0:
        acc, l_i, m_i = attend_tiles(acc, l_i, m_i, q, q_pos, lo, hi, k_cache_ptr, v_cache_ptr, table, head_off,
                                     qk_scale, stride_cb, stride_cs, d, HEAD_DIM, BLOCK_SIZE, BLOCK_D, BLOCK_N,
                                     WINDOWED, IEEE, KV_FP8, True, WINDOW, SOFTCAP)
    else:
        acc, l_i, m_i = attend_tiles(acc, l_i, m_i, q, q_pos, lo, unmasked_end, k_cache_ptr, v_cache_ptr, table,
                                     head_off, qk_scale, stride_cb, stride_cs, d, HEAD_DIM, BLOCK_SIZE, BLOCK_D,
                                     BLOCK_N, NO_MASK, IEEE, KV_FP8, SOFTCAP=SOFTCAP)
        acc, l_i, m_i = attend_tiles(acc, l_i, m_i, q, q_pos, unmasked_end, hi, k_cache_ptr, v_cache_ptr, table,
                                     head_off, qk_scale, stride_cb, stride_cs, d, HEAD_DIM, BLOCK_SIZE, BLOCK_D,
                                     BLOCK_N, CAUSAL, IEEE, KV_FP8, EMPTY_ROWS, SOFTCAP=SOFTCAP)
    return acc, l_i, m_i


@triton.jit
def attend_tiles_tma(
    acc, l_i, m_i, q, q_pos, lo, hi, k_desc, v_desc, table, kv_col, qk_scale,
    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, MASK: tl.constexpr, IEEE: tl.constexpr,
    WS: tl.constexpr = False,
):
    """attend_tiles with each K/V tile one TMA load instead of a token-by-token gather: the pool
    seen as [blocks * BLOCK_SIZE, kv heads * head_dim] (k_desc, v_desc: host TensorDescriptors of
    [BLOCK_N, head_dim] tiles), tile t at row page(t) * BLOCK_SIZE + t % BLOCK_SIZE, column kv_col.
    Needs BLOCK_SIZE % BLOCK_N == 0 and lo a multiple of BLOCK_N, so that no tile spans two pages;
    no fp8 (its scales are the gather path's). A tile's positions past hi still exist in its page
    (slots not yet written, or past this query's causal reach): MASK CAUSAL drops their scores and
    zeroes their V rows, so a stale slot cannot carry a NaN into the sum. WS: the loop is
    warp-specialised (loads in a producer warp group), Triton's tl.range(warp_specialize=)."""
    n = tl.arange(0, BLOCK_N)
    for tile in tl.range(lo, hi, BLOCK_N, warp_specialize=WS):
        page = tl.load(table + tile // BLOCK_SIZE)
        row = page * BLOCK_SIZE + tile % BLOCK_SIZE
        k = k_desc.load([row, kv_col])
        v = v_desc.load([row, kv_col])
        if IEEE:
            s = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        s = s * qk_scale
        if MASK == CAUSAL:
            pos = tile + n
            s = tl.where((pos[None, :] < hi) & (pos[None, :] <= q_pos[:, None]), s, float("-inf"))
            v = tl.where((pos < hi)[:, None], v, 0.0)
        acc, l_i, m_i = fold_tile(acc, l_i, m_i, s, v, IEEE)
    return acc, l_i, m_i
