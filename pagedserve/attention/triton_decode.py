"""Paged decode attention in Triton: one query token per sequence, flash-decoding split-K.

Grid (kv head, sequence, split), or in the slots' grid (kv head, slot): a sequence's KV heads,
whose rows are adjacent in the pool, run side by side (HEADS_FASTEST; else the head second), and
with order_ptr the sequences start longest first. A program loads each K/V tile once for all
query heads of its KV head (the GQA group is the M dimension of tl.dot, padded to >= 16) and walks
its split of the context with triton_tiles.attend_tiles, the loop the prefill kernel shares (tiles
gathered through the block table, online softmax in fp32). A sequence with one non-empty split
writes its output directly; one with several writes per-split results (normalised output,
log2-sum-exp) and reduce_splits_kernel combines them.

How a sequence is split (SPLIT_TOKENS, a compile-time mode): into base_splits equal parts, the
count the batch size asks for to fill the GPU, or into more when it is long:
  SPLIT_TOKENS > 0  so that no split holds much more than SPLIT_TOKENS positions, up to the grid's
                    num_splits (split_plan);
  BALANCED          so that no split's chain of tiles is longer than an even share of the step's
                    work: every sequence's tiles times the KV heads, over SHARE_PROGRAMS
                    (decode_plan.DECODE_SHARE_PROGRAMS_PER_SM per SM), read from seq_lens on the
                    device (balanced_chain_tiles), up to the grid's num_splits a row;
  SLOTS             the same cut, but the rows' splits lie one after another in the grid's
                    slots (slot_plan), so a long sequence may take up to max_parts (one wave of
                    programs) while the short ones beside it take their own few.
Why: a decode graph is captured once per batch size, so base_splits cannot follow the step's
lengths; at 64 sequences it is 1, and in a serving batch whose contexts run from a few tokens to
2048 the one program of the longest sequence kept walking tiles long after the others had
finished. And the rows' grid keeps within a program budget over all rows (at 16 rows 9 splits
a sequence), so a 32k-token sequence beside 15 short ones walked chains of 29 tiles where the
share asked for 4 (on the H200 such decode steps took 7.8 ms against vLLM's 6.2,
docs/long-context.md); the slots' grid cuts it into chains of 6. The slots' scans over the rows
cost every program a little, so the host picks the mode per step (decode_plan.pick_split_mode:
one decode graph per mode); a run-time choice inside one kernel cost the rows' grid 6-13% on
serving's and even steps at 8-64 rows (42nd session). Programs past the last split return at once and write nothing;
the reduction derives the same plan from the same lengths, so it reads only what was written.
base_splits and the split counts are runtime values, so one compile serves every batch size.
A layer with a sliding window (WINDOW > 0) is launched with seq_lens clamped to the window and the
lengths themselves in full_lens_ptr: every plan then sees only the positions a row reads, its last
min(length, WINDOW), and each split is shifted to them. SOFTCAP > 0 (Gemma 2): scores soft-capped.
"""
import triton
import triton.language as tl

from pagedserve.attention import decode_plan
from pagedserve.attention.triton_tiles import IN_CONTEXT, attend_tiles

# The split modes below 0 (decode_plan's names; 0 and above are split sizes).
BALANCED: tl.constexpr = tl.constexpr(decode_plan.BALANCED)
SLOTS: tl.constexpr = tl.constexpr(decode_plan.SLOTS)


# The block-table width and the split counts change from launch to launch, and the query's row
# stride with where q lives (the fused qkv projection eagerly, a piecewise graph's q buffer): one
# compile serves all (see runner/warmup.py). stride_ms is 0 without splits and BLOCK_D with them.
# max_parts: SLOTS only, the most splits of one sequence (the rows' grids have tl.num_programs(2)).
@triton.jit(do_not_specialize=["stride_qt", "stride_ot", "stride_bt", "stride_mt", "stride_mh", "stride_ms",
                               "stride_lt", "stride_lh", "base_splits", "max_parts", "num_rows"])
def paged_decode_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, mid_o_ptr, mid_lse_ptr,
    seq_lens_ptr, block_tables_ptr, qk_scale,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_cb, stride_cs, stride_ch, stride_bt,
    stride_mt, stride_mh, stride_ms, stride_lt, stride_lh, base_splits, max_parts, num_rows,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    SPLIT_TOKENS: tl.constexpr, SHARE_PROGRAMS: tl.constexpr, MIN_CHAIN_TILES: tl.constexpr,
    IEEE: tl.constexpr, HEADS_FASTEST: tl.constexpr = False, order_ptr=None,
    k_scale_ptr=None, v_scale_ptr=None, KV_FP8: tl.constexpr = False, KV_SCALE_PER_HEAD: tl.constexpr = False,
    F16_DOT: tl.constexpr = False, full_lens_ptr=None, WINDOW: tl.constexpr = 0, SOFTCAP: tl.constexpr = 0.0,
):
    if HEADS_FASTEST:
        # Grid (kv head, row[, split]): a sequence's heads run side by side and read its tokens'
        # K/V rows (all heads of a token are adjacent) at about the same time.
        kv_head = tl.program_id(0)
        cell = tl.program_id(1)
        num_kv_heads = tl.num_programs(0)
    else:
        cell = tl.program_id(0)
        kv_head = tl.program_id(1)
        num_kv_heads = tl.num_programs(1)
    if SPLIT_TOKENS == SLOTS:
        # Grid (kv head, slot): the slot is the program's place for its split's result too.
        chain = balanced_chain_tiles(seq_lens_ptr, num_rows, num_kv_heads, SHARE_PROGRAMS, MIN_CHAIN_TILES, BLOCK_N)
        seq, split, split_len, active = slot_plan(cell, seq_lens_ptr, order_ptr, num_rows, chain, base_splits,
                                                  max_parts, BLOCK_N)
        seq_len = tl.load(seq_lens_ptr + seq)
        mid_row = cell
        mid_split = 0
    else:
        # Grid (kv head, row, split).
        split = tl.program_id(2)
        seq = _row_seq(cell, order_ptr)
        seq_len = tl.load(seq_lens_ptr + seq)
        split_len, active = split_plan(seq_len, seq_lens_ptr, num_rows, num_kv_heads, tl.num_programs(2),
                                       base_splits, SPLIT_TOKENS, SHARE_PROGRAMS, MIN_CHAIN_TILES, BLOCK_N)
        mid_row = seq
        mid_split = split
    # A sliding window: seq_lens holds each row's window (min(length, WINDOW), so every plan above
    # cuts and balances the positions read), full_lens_ptr its length; the window is its last positions.
    if WINDOW > 0:
        shift = tl.load(full_lens_ptr + seq) - seq_len
    else:
        shift = 0
    if split < active:
        _decode_split(q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, mid_o_ptr, mid_lse_ptr,
                      block_tables_ptr, qk_scale, seq, kv_head, mid_row, mid_split, shift + split * split_len,
                      shift + tl.minimum(split * split_len + split_len, seq_len), active,
                      stride_qt, stride_qh, stride_ot, stride_oh, stride_cb, stride_cs, stride_ch,
                      stride_bt, stride_mt, stride_mh, stride_ms, stride_lt, stride_lh,
                      GROUP, HEAD_DIM, BLOCK_SIZE, BLOCK_G, BLOCK_D, BLOCK_N, IEEE,
                      k_scale_ptr, v_scale_ptr, KV_FP8, KV_SCALE_PER_HEAD, F16_DOT, SOFTCAP)


@triton.jit
def _row_seq(row, order_ptr):
    """The sequence of a grid row: programs start in grid order, so with order_ptr (longest first)
    no long chain starts last."""
    if order_ptr is None:
        return row
    else:
        return tl.load(order_ptr + row)


@triton.jit
def split_plan(seq_len, seq_lens_ptr, num_rows, num_kv_heads, num_splits, base_splits,
               SPLIT_TOKENS: tl.constexpr, SHARE_PROGRAMS: tl.constexpr, MIN_CHAIN_TILES: tl.constexpr,
               BLOCK_N: tl.constexpr):
    """(split_len, number of non-empty splits) of a sequence of seq_len positions in a grid of
    num_splits a row: base_splits parts, or more by SPLIT_TOKENS (> 0, or BALANCED: see the module
    docstring), at most num_splits; split_len rounded up to whole tiles. The decode and the reduce
    kernel agree on it."""
    # tl.cdiv is itself a @jit function, which the interpreter cannot call from our kernels.
    if SPLIT_TOKENS > 0:
        parts = tl.minimum(tl.maximum((seq_len + SPLIT_TOKENS - 1) // SPLIT_TOKENS, base_splits), num_splits)
    elif SPLIT_TOKENS == BALANCED:
        chain = balanced_chain_tiles(seq_lens_ptr, num_rows, num_kv_heads, SHARE_PROGRAMS, MIN_CHAIN_TILES, BLOCK_N)
        parts = _balanced_parts(seq_len, chain, base_splits, num_splits, BLOCK_N)
    else:
        parts = base_splits
    return _cut(seq_len, parts, BLOCK_N)


@triton.jit
def _cut(seq_len, parts, BLOCK_N: tl.constexpr):
    """(split_len, non-empty splits) of seq_len positions in `parts` parts of whole tiles (0 splits
    for an empty length; parts >= 1)."""
    split_len = tl.maximum(((seq_len + parts - 1) // parts + BLOCK_N - 1) // BLOCK_N * BLOCK_N, BLOCK_N)
    return split_len, (seq_len + split_len - 1) // split_len


@triton.jit
def _balanced_parts(seq_len, chain, base_splits, most, BLOCK_N: tl.constexpr):
    """The balanced plan's parts of seq_len (a scalar or a block of lengths): parts of at most
    `chain` tiles, at least base_splits, at most `most`. In the slots' grid a row has this many
    slots; rounding to whole tiles may leave its last ones empty (_cut)."""
    tiles = (seq_len + BLOCK_N - 1) // BLOCK_N
    return tl.minimum(tl.maximum((tiles + chain - 1) // chain, base_splits), most)


@triton.jit
def balanced_chain_tiles(seq_lens_ptr, num_rows, num_kv_heads, SHARE_PROGRAMS: tl.constexpr,
                         MIN_CHAIN_TILES: tl.constexpr, BLOCK_N: tl.constexpr):
    """The tiles one program may walk without outlasting an even share of the step: all tiles of
    all sequences and KV heads over SHARE_PROGRAMS, at least MIN_CHAIN_TILES. Every program computes it
    from seq_lens (a few hundred int32 in L2), so no plan travels from the host."""
    CHUNK: tl.constexpr = 256
    total = tl.zeros([CHUNK], dtype=tl.int32)
    for start in range(0, num_rows, CHUNK):
        offs = start + tl.arange(0, CHUNK)
        lens = tl.load(seq_lens_ptr + offs, mask=offs < num_rows, other=0)
        total += (lens + BLOCK_N - 1) // BLOCK_N
    work = tl.sum(total, 0) * num_kv_heads
    return tl.maximum((work + SHARE_PROGRAMS - 1) // SHARE_PROGRAMS, MIN_CHAIN_TILES)


@triton.jit
def slot_plan(slot, seq_lens_ptr, order_ptr, num_rows, chain, base_splits, max_parts, BLOCK_N: tl.constexpr):
    """(sequence, split, split_len, its non-empty splits) of a slot of the slots' grid: the rows (in
    order_ptr's order, else row order) hold their parts (_balanced_parts) one after another, slot 0
    the first row's first. A slot past a row's non-empty splits, or past the last row's, gets a
    split >= its row's count (no work). Counting parts, not non-empty splits, spares the scan two
    integer divisions a row."""
    CHUNK: tl.constexpr = 256
    done = tl.full([], 0, tl.int32)    # slots of the rows before this chunk
    rank = tl.full([], 0, tl.int32) + num_rows
    first = tl.full([], 0, tl.int32)   # the slot of rank's first split
    for start in range(0, num_rows, CHUNK):
        in_rows, counts = _ranked_parts(start, num_rows, seq_lens_ptr, order_ptr, chain, base_splits, max_parts,
                                        BLOCK_N, CHUNK)
        ends = tl.cumsum(counts, 0) + done  # each row's slots end before this slot
        before = (ends <= slot) & in_rows
        total = tl.sum(counts, 0)
        here = (slot >= done) & (slot < done + total)
        rank = tl.where(here, start + tl.sum(before.to(tl.int32), 0), rank)
        first = tl.where(here, tl.max(tl.where(before, ends, done), 0), first)
        done += total
    found = rank < num_rows
    seq = _row_seq(tl.minimum(rank, num_rows - 1), order_ptr)
    split_len, active = _cut(tl.load(seq_lens_ptr + seq), _balanced_parts(tl.load(seq_lens_ptr + seq), chain,
                                                                           base_splits, max_parts, BLOCK_N), BLOCK_N)
    return seq, tl.where(found, slot - first, max_parts), split_len, active


@triton.jit
def slot_offset(rank, seq_lens_ptr, order_ptr, num_rows, chain, base_splits, max_parts, BLOCK_N: tl.constexpr):
    """The slot of the first split of the row at `rank` (in order_ptr's order): the parts of the
    rows before it (slot_plan's layout)."""
    CHUNK: tl.constexpr = 256
    done = tl.full([], 0, tl.int32)
    for start in range(0, num_rows, CHUNK):
        _, counts = _ranked_parts(start, rank, seq_lens_ptr, order_ptr, chain, base_splits, max_parts, BLOCK_N, CHUNK)
        done += tl.sum(counts, 0)
    return done


@triton.jit
def _ranked_parts(start, limit, seq_lens_ptr, order_ptr, chain, base_splits, max_parts, BLOCK_N: tl.constexpr,
                  CHUNK: tl.constexpr):
    """(in range, parts) of the rows at ranks start .. start + CHUNK - 1 (in order_ptr's order, else
    row order): _balanced_parts of those below `limit`, 0 for the rest."""
    offs = start + tl.arange(0, CHUNK)
    in_range = offs < limit
    if order_ptr is None:
        rows = offs
    else:
        rows = tl.load(order_ptr + offs, mask=in_range, other=0)
    lens = tl.load(seq_lens_ptr + rows, mask=in_range, other=0)
    return in_range, tl.where(in_range, _balanced_parts(lens, chain, base_splits, max_parts, BLOCK_N), 0)


@triton.jit
def _decode_split(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, mid_o_ptr, mid_lse_ptr, block_tables_ptr, qk_scale,
    seq, kv_head, mid_row, mid_split, start, end, active,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_cb, stride_cs, stride_ch, stride_bt,
    stride_mt, stride_mh, stride_ms, stride_lt, stride_lh,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    IEEE: tl.constexpr, k_scale_ptr, v_scale_ptr, KV_FP8: tl.constexpr, KV_SCALE_PER_HEAD: tl.constexpr,
    F16_DOT: tl.constexpr, SOFTCAP: tl.constexpr = 0.0,
):
    """Positions [start, end) of one sequence for the query heads of one KV head: the output
    itself when the sequence has one split (active), else this split's part for the reduce, at
    (mid_row, mid_split) of the split buffers ((sequence, split), or (slot, 0) when balanced).
    KV_SCALE_PER_HEAD: the fp8 scales are [num_kv_heads] and this program reads its head's.
    F16_DOT (fp8 only, not with IEEE): q becomes fp16, so attend_tiles casts the e4m3 tiles to
    fp16, the cast the hardware does in one packed instruction, and the dots run in fp16."""

    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    heads = kv_head * GROUP + g
    g_mask = g < GROUP
    if BLOCK_D == HEAD_DIM:
        q_mask = g_mask[:, None]
    else:
        q_mask = g_mask[:, None] & (d[None, :] < HEAD_DIM)
    q = tl.load(q_ptr + seq.to(tl.int64) * stride_qt + heads[:, None] * stride_qh + d[None, :],
                mask=q_mask, other=0.0)
    if IEEE:
        q = q.to(tl.float32)
    elif not KV_FP8:
        q = q.to(k_cache_ptr.dtype.element_ty)
    elif F16_DOT:
        # Every e4m3 value is exact in fp16, and a bf16 q loses nothing in fp16's normal range
        # (|q| in [2^-14, 65504]: fp16 has more mantissa bits). Beyond it q saturates rather than
        # becoming inf (and the scores NaN): only a degenerate query reaches that far.
        q = tl.minimum(tl.maximum(q.to(tl.float32), -65504.0), 65504.0).to(tl.float16)
    if KV_FP8:
        if KV_SCALE_PER_HEAD:
            qk_scale = qk_scale * tl.load(k_scale_ptr + kv_head)
        else:
            qk_scale = qk_scale * tl.load(k_scale_ptr)  # dequantizing K is one multiply per score

    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.full([BLOCK_G], 0.0, tl.float32)
    acc = tl.full([BLOCK_G, BLOCK_D], 0.0, tl.float32)
    table = block_tables_ptr + seq.to(tl.int64) * stride_bt
    # q_pos (heads) is not read: IN_CONTEXT masks by position < end only.
    acc, l_i, m_i = attend_tiles(acc, l_i, m_i, q, heads, start, end,
                                 k_cache_ptr, v_cache_ptr, table, kv_head * stride_ch, qk_scale,
                                 stride_cb, stride_cs, d,
                                 HEAD_DIM, BLOCK_SIZE, BLOCK_D, BLOCK_N, IN_CONTEXT, IEEE, KV_FP8,
                                 SOFTCAP=SOFTCAP)

    # Every split that runs holds at least one position, so l_i > 0.
    out = acc / l_i[:, None]
    if KV_FP8:
        if KV_SCALE_PER_HEAD:
            out = out * tl.load(v_scale_ptr + kv_head)
        else:
            out = out * tl.load(v_scale_ptr)  # V's scale, once per output (the reduce is linear in it)
    if active == 1:
        tl.store(out_ptr + seq.to(tl.int64) * stride_ot + heads[:, None] * stride_oh + d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=q_mask)
    else:
        lse = m_i + tl.log2(l_i)
        mid = mid_row.to(tl.int64) * stride_mt + heads * stride_mh + mid_split * stride_ms
        tl.store(mid_o_ptr + mid[:, None] + d[None, :], out, mask=q_mask)
        tl.store(mid_lse_ptr + mid_row.to(tl.int64) * stride_lt + heads * stride_lh + mid_split, lse, mask=g_mask)


@triton.jit(do_not_specialize=["stride_mt", "stride_mh", "stride_ms", "stride_lt", "stride_lh", "stride_ot",
                                "num_kv_heads", "num_splits", "base_splits"])
def reduce_splits_kernel(
    mid_o_ptr, mid_lse_ptr, out_ptr, seq_lens_ptr,
    stride_mt, stride_mh, stride_ms, stride_lt, stride_lh, stride_ot, stride_oh,
    num_kv_heads, num_splits, base_splits,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    SPLIT_TOKENS: tl.constexpr, SHARE_PROGRAMS: tl.constexpr, MIN_CHAIN_TILES: tl.constexpr,
    BLOCK_S: tl.constexpr, order_ptr=None,
):
    """Program (row, head): out = sum_s 2^(lse_s - lse) * o_s over the row's sequence's non-empty
    splits, where the decode kernel put them (split_plan's (sequence, split), or SLOTS: slot_plan's
    slots); a sequence with one split already has its output. num_splits: the grid's most splits of
    one sequence (SLOTS: max_parts). order_ptr: SLOTS only, the rows in the decode grid's order (a
    row's rank places its slots)."""
    row = tl.program_id(0)
    head = tl.program_id(1)
    num_rows = tl.num_programs(0)
    d = tl.arange(0, BLOCK_D)
    s = tl.arange(0, BLOCK_S)
    if SPLIT_TOKENS == SLOTS:
        seq = _row_seq(row, order_ptr)
        seq_len = tl.load(seq_lens_ptr + seq)
        chain = balanced_chain_tiles(seq_lens_ptr, num_rows, num_kv_heads, SHARE_PROGRAMS, MIN_CHAIN_TILES, BLOCK_N)
        _, active = _cut(seq_len, _balanced_parts(seq_len, chain, base_splits, num_splits, BLOCK_N), BLOCK_N)
        if active > 1:
            # BLOCK_S splits at a time: a row may have up to a wave of them (49 at 8 KV heads on 132
            # SMs), in consecutive slots.
            first = slot_offset(row, seq_lens_ptr, order_ptr, num_rows, chain, base_splits, num_splits,
                                BLOCK_N).to(tl.int64)
            base = first * stride_mt + head * stride_mh
            lse_base = first * stride_lt + head * stride_lh
            top = tl.full([], float("-inf"), tl.float32)
            for s0 in range(0, active, BLOCK_S):
                lse = tl.load(mid_lse_ptr + lse_base + (s0 + s) * stride_lt, mask=s0 + s < active,
                              other=float("-inf"))
                top = tl.maximum(top, tl.max(lse, 0))
            acc = tl.zeros([BLOCK_D], dtype=tl.float32)
            total = tl.full([], 0.0, tl.float32)
            for s0 in range(0, active, BLOCK_S):
                live = s0 + s < active
                w = tl.exp2(tl.load(mid_lse_ptr + lse_base + (s0 + s) * stride_lt, mask=live,
                                    other=float("-inf")) - top)
                o = tl.load(mid_o_ptr + base + (s0 + s)[:, None].to(tl.int64) * stride_mt + d[None, :],
                            mask=live[:, None] & (d[None, :] < HEAD_DIM), other=0.0)
                acc += tl.sum(o * w[:, None], 0)
                total += tl.sum(w, 0)
            out = acc / total
            tl.store(out_ptr + seq.to(tl.int64) * stride_ot + head * stride_oh + d,
                     out.to(out_ptr.dtype.element_ty), mask=d < HEAD_DIM)
    else:
        # One block of BLOCK_S >= the grid's splits a row (next_power_of_2(num_splits)).
        seq = row
        _, active = split_plan(tl.load(seq_lens_ptr + seq), seq_lens_ptr, num_rows, num_kv_heads, num_splits,
                               base_splits, SPLIT_TOKENS, SHARE_PROGRAMS, MIN_CHAIN_TILES, BLOCK_N)
        if active > 1:
            base = seq.to(tl.int64) * stride_mt + head * stride_mh
            lse = tl.load(mid_lse_ptr + seq.to(tl.int64) * stride_lt + head * stride_lh + s, mask=s < active,
                          other=float("-inf"))
            w = tl.exp2(lse - tl.max(lse, 0))
            w = w / tl.sum(w, 0)
            o = tl.load(mid_o_ptr + base + s[:, None] * stride_ms + d[None, :],
                        mask=(s[:, None] < active) & (d[None, :] < HEAD_DIM), other=0.0)
            out = tl.sum(o * w[:, None], 0)
            tl.store(out_ptr + seq.to(tl.int64) * stride_ot + head * stride_oh + d,
                     out.to(out_ptr.dtype.element_ty), mask=d < HEAD_DIM)
