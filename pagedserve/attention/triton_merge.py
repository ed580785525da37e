"""Merging partial attentions in one pass: the long-prefill path's last step (gathered_prefill.py).

A long chunk's attention is computed in two or three parts over disjoint keys (the prefix's
bucketed head, its tail, the chunk's own square), each with its log-sum-exp. gathered_prefill.merge
combines them with torch ops in float32: a cast, a product and a sum per part, a division and a
cast back, each a full pass over [heads, rows, head_dim]: ~3 GB of traffic for a 16k-token chunk
of Llama-3.1-8B per layer (in a 100k prefill on the H200, 7.3 s, float elementwise kernels took
0.17 s and copies 0.2 s, some of them this merge's: runs/s33_prefill_profile/). This kernel reads
each part once and writes the chunk's rows straight into the layer's output ([tokens, heads,
head_dim]), skipping the rows that only pad the query bucket. The default (gathered_prefill_switches.MERGE_ENV):
a 100k prefill 7.23-7.28 s with the torch merge, 7.01-7.06 s with this one on the H200.

Grid (row tiles, heads). Each program loads its rows' log-sum-exps of every part, weights each
part by exp(lse - max), and stores sum(w * out) / sum(w) in the output's dtype, accumulating in
float32 (as merge does).
"""
import torch
import triton
import triton.language as tl

from pagedserve.host_math import stride_unit

MERGE_BLOCK_R = 32
# Warps a program by part count: on the H200, one 8,192-token chunk of Llama-3.1-8B (32 heads),
# rows of 32: 2 parts 108 us at 4 warps (123 at 8), 3 parts 146 us at 8 (208 at 4); rows of 64 or
# 128 slower at either (runs/s38_long_context/merge_bench.json in history.tar.gz). A grid with heads
# fastest (programs running together writing whole output rows) timed the same (runs/s39_long_context/).
# Those ran 2 bytes an access; at 16 (strides in units of 16, below; one H100, runs/s60_h100/): 2 parts
# 73.7 us at 4 warps (73.6 at 8; 107.3 before), 3 parts 94.3 at 8 (95.5 at 4; 152.4 before).
MERGE_NUM_WARPS = {2: 4, 3: 8}


# A chunk's row count and the parts' strides change from chunk to chunk: one compile per part
# count and dtype serves all (warmed up by gathered_prefill.warm_up_plans).
@triton.jit(do_not_specialize=["rows", "so0h", "so0r", "so1h", "so1r", "so2h", "so2r", "sl0h", "sl1h", "sl2h",
                               "sout_r", "sout_h"])
def merge_parts_kernel(o0, o1, o2, l0, l1, l2, out_ptr, rows,
                       so0h, so0r, so1h, so1r, so2h, so2r,
                       sl0h, sl1h, sl2h, sout_r, sout_h,
                       NUM_PARTS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                       BLOCK_R: tl.constexpr, STRIDE_UNIT: tl.constexpr):
    # The parts' and the output's head and row strides come in units of STRIDE_UNIT elements (see
    # merge_into): multiplied back here by a constant, which tells the compiler how rows align.
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    h = tl.program_id(1)
    d = tl.arange(0, BLOCK_D)
    rm = r < rows
    m2 = rm[:, None] & (d < HEAD_DIM)[None, :]
    # Each part's log-sum-exp has unit stride along the rows (a [heads, rows] view of SDPA's).
    lse0 = tl.load(l0 + h * sl0h + r, mask=rm, other=0.0).to(tl.float32)
    lse1 = tl.load(l1 + h * sl1h + r, mask=rm, other=0.0).to(tl.float32)
    top = tl.maximum(lse0, lse1)
    if NUM_PARTS == 3:
        lse2 = tl.load(l2 + h * sl2h + r, mask=rm, other=0.0).to(tl.float32)
        top = tl.maximum(top, lse2)
    w0 = tl.exp(lse0 - top)
    w1 = tl.exp(lse1 - top)
    at0 = o0 + (h * so0h + r[:, None] * so0r) * STRIDE_UNIT + d[None, :]
    at1 = o1 + (h * so1h + r[:, None] * so1r) * STRIDE_UNIT + d[None, :]
    acc = w0[:, None] * tl.load(at0, mask=m2, other=0.0).to(tl.float32)
    acc += w1[:, None] * tl.load(at1, mask=m2, other=0.0).to(tl.float32)
    total = w0 + w1
    if NUM_PARTS == 3:
        w2 = tl.exp(lse2 - top)
        at2 = o2 + (h * so2h + r[:, None] * so2r) * STRIDE_UNIT + d[None, :]
        acc += w2[:, None] * tl.load(at2, mask=m2, other=0.0).to(tl.float32)
        total += w2
    acc = acc / total[:, None]
    at = out_ptr + (r[:, None] * sout_r + h * sout_h) * STRIDE_UNIT + d[None, :]
    tl.store(at, acc.to(out_ptr.dtype.element_ty), mask=m2)


def merge_into(parts: list[tuple[torch.Tensor, torch.Tensor]], out: torch.Tensor) -> torch.Tensor:
    """gathered_prefill.merge of 2 or 3 parts ([H, rows, D] outputs, each with its [H, rows]
    log-sum-exp), its first out.shape[0] rows written into out ([c, H, D], any row and head
    strides, unit stride along D) in one pass; returns out."""
    if len(parts) not in (2, 3):
        raise ValueError(f"merge_into merges 2 or 3 parts, got {len(parts)}")
    c, H, D = out.shape
    for o, lse in parts:
        if o.shape[0] != H or o.shape[2] != D or o.shape[1] < c or tuple(lse.shape) != tuple(o.shape[:2]):
            raise ValueError(f"merge_into: part {tuple(o.shape)} (lse {tuple(lse.shape)}) does not cover "
                             f"out {tuple(out.shape)}")
    if out.stride(2) != 1:
        raise ValueError("merge_into: out needs a unit stride along head_dim")
    # The kernel walks D and the rows of a log-sum-exp with unit strides (SDPA's outputs have them).
    parts = [(o if o.stride(2) == 1 else o.contiguous(), lse if lse.stride(1) == 1 else lse.contiguous())
             for o, lse in parts]
    (o0, l0), (o1, l1) = parts[:2]
    o2, l2 = parts[2] if len(parts) == 3 else parts[0]
    # Strides left unspecialized (one compile serves every chunk) tell the compiler nothing of the
    # rows' alignment, so it loads and stores them 2 bytes at a time (~40% of the H200's bandwidth,
    # 38th session). Where every head and row stride is a multiple of 16 (head_dim a multiple of 16:
    # the parts' and the output's strides are multiples of it) they go in units of 16 elements, and
    # the kernel moves 16 bytes an access (host_math.stride_unit).
    strides = [o.stride(i) for o in (o0, o1, o2, out) for i in (0, 1)]
    unit = stride_unit(*strides)
    so0h, so0r, so1h, so1r, so2h, so2r, sout_r, sout_h = (s // unit for s in strides)
    grid = (triton.cdiv(c, MERGE_BLOCK_R), H)
    merge_parts_kernel[grid](o0, o1, o2, l0, l1, l2, out, c, so0h, so0r, so1h, so1r, so2h, so2r,
                             l0.stride(0), l1.stride(0), l2.stride(0), sout_r, sout_h,
                             NUM_PARTS=len(parts), HEAD_DIM=D, BLOCK_D=triton.next_power_of_2(D),
                             BLOCK_R=MERGE_BLOCK_R, STRIDE_UNIT=unit, num_warps=MERGE_NUM_WARPS[len(parts)])
    return out
