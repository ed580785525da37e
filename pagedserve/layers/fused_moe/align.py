"""Tokens sorted by expert and padded to the GEMM block size, on the device, with no host sync.

The grouped GEMM (triton_moe.py) gives each program a block of BLOCK_M rows that all belong to
one expert. Rows are the T * top_k (token, slot) pairs, named by their flat index t * top_k + k.
align_block_size lays them out expert by expert, each expert's run padded to a multiple of
BLOCK_M with the sentinel T * top_k (a row the kernel neither reads nor writes):

    sorted_ids [max_padded]        flat pair indices, grouped by expert, sentinel-padded
    block_expert [max_padded / M]  the expert of each block (-1 past the last used block)
    num_padded [1]                 rows actually used (the kernel's programs past it return)

An id equal to E drops its pair: it is laid out in an extra run, after the experts', whose blocks
have expert -1, so the kernel skips them (expert parallelism routes another rank's experts there).

max_padded = T*top_k + min(T*top_k, E + 1) * (BLOCK_M - 1) bounds the used rows whatever the routing,
so every size is a function of the shapes alone: capturable in a CUDA graph. An expert that no
pair chose gets no block; an expert chosen twice by one token (not possible from top-k routing,
but the dispatch does not assume it) gets both pairs. Within an expert the pairs keep their
flat order (a stable sort), so the layout is deterministic.
"""
from __future__ import annotations

import torch


def max_padded_rows(num_pairs: int, num_experts: int, block_m: int) -> int:
    """Rows that always suffice: each non-empty run (the experts', and the dropped one) pads < BLOCK_M."""
    return num_pairs + min(num_pairs, num_experts + 1) * (block_m - 1)


def align_block_size(topk_ids: torch.Tensor, num_experts: int,
                     block_m: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(sorted_ids int32, block_expert int32, num_padded int32 [1]) for topk_ids [T, top_k] with
    ids in [0, num_experts] (num_experts: dropped)."""
    device = topk_ids.device
    flat = topk_ids.reshape(-1).to(torch.int64)
    n = flat.numel()
    max_padded = max_padded_rows(n, num_experts, block_m)
    counts = torch.zeros(num_experts + 1, dtype=torch.int64, device=device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))  # not bincount: its size check syncs
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = torch.cumsum(padded, 0)
    padded_start = padded_end - padded
    count_start = torch.cumsum(counts, 0) - counts
    order = torch.sort(flat, stable=True).indices  # pair indices, grouped by expert
    experts_in_order = flat[order]
    rank = torch.arange(n, device=device) - count_start[experts_in_order]
    dest = padded_start[experts_in_order] + rank
    sorted_ids = torch.full((max_padded,), n, dtype=torch.int32, device=device)
    sorted_ids.scatter_(0, dest, order.to(torch.int32))
    block_start = torch.arange(0, max_padded, block_m, device=device)
    block_expert = torch.searchsorted(padded_end, block_start, right=True)
    block_expert = torch.where(block_expert < num_experts, block_expert, -1).to(torch.int32)
    return sorted_ids, block_expert, padded_end[-1:].to(torch.int32)
