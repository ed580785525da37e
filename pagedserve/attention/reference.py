"""Paged attention in plain torch: the CPU path, and the oracle every kernel is tested against.

K/V live only in the block pools ([num_blocks, block_size, num_kv_heads, head_dim]);
each sequence's context is gathered through its block table, one sequence at a time.
"""
from __future__ import annotations

import torch

from pagedserve.attention.kv_quant import dequantize_kv, is_fp8, quantize_kv
from pagedserve.attention.metadata import AttentionMetadata


def write_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor, k_scale: torch.Tensor | None = None,
             v_scale: torch.Tensor | None = None) -> None:
    """Scatter new K/V ([num_tokens, num_kv_heads, head_dim]) into their slots; slot -1 is skipped.
    An fp8 pool gets x / scale in e4m3 (kv_quant); other pools ignore the scales."""
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    block_size = k_cache.shape[1]
    blocks, offsets = slots // block_size, slots % block_size
    if is_fp8(k_cache):  # through uint8 views: index_put has no fp8 kernel on every device
        k_cache.view(torch.uint8)[blocks, offsets] = quantize_kv(key[keep], k_scale).view(torch.uint8)
        v_cache.view(torch.uint8)[blocks, offsets] = quantize_kv(value[keep], v_scale).view(torch.uint8)
        return
    k_cache[blocks, offsets] = key[keep].to(k_cache.dtype)
    v_cache[blocks, offsets] = value[keep].to(v_cache.dtype)


def gather_kv(cache: torch.Tensor, block_table: torch.Tensor, seq_len: int) -> torch.Tensor:
    """[seq_len, num_kv_heads, head_dim] of one sequence, read through its block table."""
    block_size = cache.shape[1]
    num_blocks = (seq_len + block_size - 1) // block_size
    if is_fp8(cache):  # gathered as bytes (see write_kv), read back as e4m3
        return cache.view(torch.uint8)[block_table[:num_blocks].long()].flatten(0, 1)[:seq_len].view(cache.dtype)
    return cache[block_table[:num_blocks].long()].flatten(0, 1)[:seq_len]


def paged_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    meta: AttentionMetadata, scale: float, k_scale: torch.Tensor | None = None,
                    v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of each sequence's new tokens over its whole paged context.

    query: [num_tokens, num_heads, head_dim]; returns the same shape. Query token j of a
    sequence with q new tokens and context L sits at position L - q + j and sees
    positions <= its own. An fp8 pool is read as stored * k_scale (v_scale).
    """
    out = torch.empty_like(query)
    num_heads, num_kv_heads = query.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    starts = meta.query_start_loc.tolist()
    seq_lens = meta.seq_lens_cpu if meta.seq_lens_cpu is not None else meta.seq_lens.tolist()
    for i, seq_len in enumerate(seq_lens):
        lo, hi = starts[i], starts[i + 1]
        q = query[lo:hi].float()                                   # [q, H, D]
        k = dequantize_kv(gather_kv(k_cache, meta.block_tables[i], seq_len), k_scale)  # [L, Hkv, D]
        v = dequantize_kv(gather_kv(v_cache, meta.block_tables[i], seq_len), v_scale)
        k = k.repeat_interleave(group, dim=1)
        v = v.repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q, k) * scale        # [H, q, L]
        q_pos = torch.arange(seq_len - (hi - lo), seq_len, device=query.device)
        k_pos = torch.arange(seq_len, device=query.device)
        scores.masked_fill_(k_pos[None, None, :] > q_pos[None, :, None], float("-inf"))
        probs = scores.softmax(dim=-1)
        out[lo:hi] = torch.einsum("hqk,khd->qhd", probs, v).to(query.dtype)
    return out


def copy_blocks(k_caches: list[torch.Tensor], v_caches: list[torch.Tensor],
                pairs: list[tuple[int, int]]) -> None:
    """Copy-on-write: block src -> block dst in every layer's pools."""
    if not pairs:
        return
    src = torch.tensor([p[0] for p in pairs], device=k_caches[0].device)
    dst = torch.tensor([p[1] for p in pairs], device=k_caches[0].device)
    for k, v in zip(k_caches, v_caches):
        k[dst] = k[src]
        v[dst] = v[src]
