"""Folding a long chunk's queries for cuDNN in one pass: the long-prefill path's first step
(gathered_prefill.py).

The gathered path hands cuDNN the chunk's queries heads first, padded with zero rows to the query
bucket: [H, rows, D], which viewed [Hkv, group * rows, D] folds each KV group's query heads into
the query length. The queries arrive as rows of the step's qkv ([c, H, D], row stride the qkv's
width). Torch made the fold as a permuted copy plus a fill of the padding rows, two passes at
~1.2 TB/s on the H200 (42 ms of a 100k prefill's 7 s, runs/s37_long_context/ in
history.tar.gz). This kernel reads each query row once and writes the folded rows and the
padding in one launch: 38.4 against 86.1 us for an 8,192-token chunk of Llama-3.1-8B (3.5 against
1.6 TB/s; runs/s39_long_context/lease_a/glue_bench.json).

Grid (heads, row tiles), heads fastest: programs running together cover whole query rows (each
reads 32 of them, D values of one head) and write whole stretches of the output.
"""
import torch
import triton
import triton.language as tl

# Of rows 16 / 32 / 64 at 2 / 4 / 8 warps, 32 x 4 was the fastest at chunks of 8,192 and 5,000 tokens
# (3.49 / 3.46 TB/s; 64 x 2 ran at half that; glue_bench.json).
FOLD_BLOCK_R = 32
FOLD_NUM_WARPS = 4


# The chunk's length, the bucket's and the queries' strides change from chunk to chunk (and model
# to model): one compile per dtype and head size serves all (warmed up by gathered_prefill.warm_up_plans).
@triton.jit(do_not_specialize=["c", "rows", "sq_r", "sq_h"])
def fold_queries_kernel(q_ptr, out_ptr, c, rows, sq_r, sq_h,
                        HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_R: tl.constexpr):
    h = tl.program_id(0)
    r = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
    d = tl.arange(0, BLOCK_D)
    dm = (d < HEAD_DIM)[None, :]
    # Rows past c are the bucket's padding: zeros (their outputs are dropped; stale memory could be NaN).
    x = tl.load(q_ptr + r[:, None] * sq_r + h * sq_h + d[None, :], mask=(r < c)[:, None] & dm, other=0.0)
    tl.store(out_ptr + (h * rows + r[:, None]) * HEAD_DIM + d[None, :], x, mask=(r < rows)[:, None] & dm)


def fold_into(q: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """q [c, H, D] (any row and head strides, unit stride along D) into out [H, rows, D]
    (contiguous, rows >= c): out[h, r] = q[r, h] for r < c, zeros past; returns out."""
    c, H, D = q.shape
    if out.dim() != 3 or out.shape[0] != H or out.shape[2] != D or out.shape[1] < c or not out.is_contiguous():
        raise ValueError(f"fold_into: out {tuple(out.shape)} must be a contiguous [H, rows >= c, D] "
                         f"for q {tuple(q.shape)}")
    if q.stride(2) != 1 or q.dtype != out.dtype:
        raise ValueError("fold_into: q needs a unit stride along head_dim and out's dtype")
    rows = out.shape[1]
    grid = (H, triton.cdiv(rows, FOLD_BLOCK_R))
    fold_queries_kernel[grid](q, out, c, rows, q.stride(0), q.stride(1), HEAD_DIM=D,
                              BLOCK_D=triton.next_power_of_2(D), BLOCK_R=FOLD_BLOCK_R, num_warps=FOLD_NUM_WARPS)
    return out
