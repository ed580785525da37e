"""align.py's sort/pad as one Triton program, for the small batches of decode steps.

The torch version is some twenty small kernels; in a decode step of a 48-layer MoE model that is
~1000 launches of a few microseconds each, against one here (vLLM's moe_align_block_size is one
CUDA kernel for the same reason). One program holds every (token, slot) pair, so this serves up
to MAX_PAIRS pairs; larger steps (prefill chunks, whose GEMMs dwarf the launches) use align.py.
Same outputs, bit for bit, as align.align_block_size:

1. per-expert counts (a histogram), padded to BLOCK_M, their exclusive prefix sums;
2. the pairs sorted by (expert, flat index): a stable grouping;
3. each sorted pair goes to its expert's padded start plus its rank within the expert;
4. each row block's expert = the number of experts whose padded run ends at or before it (-1 from
   E on: the dropped run, id E, and past the end).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedserve.layers.fused_moe.align import max_padded_rows
from pagedserve.host_math import cdiv, next_power_of_2

MAX_PAIRS = 4096


@triton.jit(do_not_specialize=["N", "EM", "NUM_BLOCKS"])
def _align_kernel(ids_ptr, sorted_ptr, block_expert_ptr, num_padded_ptr, N, EM, NUM_BLOCKS,
                  NUM_EXPERTS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                  BLOCK_E: tl.constexpr, CHUNK: tl.constexpr):
    i = tl.arange(0, BLOCK_N)
    valid = i < N
    e = tl.load(ids_ptr + i, mask=valid, other=0).to(tl.int32)
    counts = tl.histogram(e, BLOCK_E, mask=valid)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    padded_end = tl.cumsum(padded, 0)
    padded_start = padded_end - padded
    count_start = tl.cumsum(counts, 0) - counts
    # Sorting e * BLOCK_N + i groups by expert and keeps flat order inside; invalid lanes sort last.
    key = tl.sort(tl.where(valid, e * BLOCK_N + i, BLOCK_E * BLOCK_N))
    pos = tl.arange(0, BLOCK_N)
    in_range = pos < N
    expert = tl.where(in_range, key // BLOCK_N, 0)
    dest = tl.gather(padded_start, expert, 0) + pos - tl.gather(count_start, expert, 0)
    # Sentinel everywhere first; the barrier orders those stores before the scatter below.
    c = tl.arange(0, CHUNK)
    for start in range(0, EM, CHUNK):
        tl.store(sorted_ptr + start + c, N, mask=start + c < EM)
    tl.debug_barrier()
    tl.store(sorted_ptr + dest, key % BLOCK_N, mask=in_range)
    for b0 in range(0, NUM_BLOCKS, CHUNK):
        b = b0 + c
        owner = tl.sum((padded_end[None, :] <= (b * BLOCK_M)[:, None]).to(tl.int32), axis=1)
        tl.store(block_expert_ptr + b, tl.where(owner < NUM_EXPERTS, owner, -1), mask=b < NUM_BLOCKS)
    tl.store(num_padded_ptr, tl.sum(padded, 0))


def align_block_size(topk_ids: torch.Tensor, num_experts: int,
                     block_m: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """align.align_block_size for at most MAX_PAIRS pairs, in one launch."""
    n = topk_ids.numel()
    if n > MAX_PAIRS:
        raise ValueError(f"one-program align takes at most {MAX_PAIRS} pairs, got {n}")
    device = topk_ids.device
    em = max_padded_rows(n, num_experts, block_m)
    num_blocks = cdiv(em, block_m)
    sorted_ids = torch.empty(em, dtype=torch.int32, device=device)
    block_expert = torch.empty(num_blocks, dtype=torch.int32, device=device)
    num_padded = torch.empty(1, dtype=torch.int32, device=device)
    ids = topk_ids.reshape(-1)
    if not ids.is_contiguous():
        ids = ids.contiguous()
    _align_kernel[(1,)](ids, sorted_ids, block_expert, num_padded, n, em, num_blocks,
                        NUM_EXPERTS=num_experts, BLOCK_M=block_m, BLOCK_N=max(16, next_power_of_2(n)),
                        BLOCK_E=max(16, next_power_of_2(num_experts + 1)), CHUNK=128,
                        num_warps=8 if n > 1024 else 4)
    return sorted_ids, block_expert, num_padded
