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
    # Shapes never depend on the values (so a graph stand-in can record it, runner/full_graphs.py):
    # a row with slot -1 repeats the first written row (the same value to the same slot), or, when
    # no row writes, every row puts slot 0's own value back.
    if slot_mapping.numel() == 0:
        return
    keep = slot_mapping >= 0
    rows = torch.arange(slot_mapping.shape[0], device=slot_mapping.device)
    src = torch.where(keep, rows, keep.to(torch.int8).argmax())
    slots = slot_mapping[src].clamp(min=0)
    any_kept = keep.any()
    block_size = k_cache.shape[1]
    blocks, offsets = slots // block_size, slots % block_size
    fp8 = is_fp8(k_cache)
    for cache, x, scale in ((k_cache, key, k_scale), (v_cache, value, v_scale)):
        if fp8:  # through uint8 views: index_put has no fp8 kernel on every device
            cache, new = cache.view(torch.uint8), quantize_kv(x[src], scale).view(torch.uint8)
        else:
            new = x[src].to(cache.dtype)
        cache[blocks, offsets] = torch.where(any_kept, new, cache[blocks, offsets])


def gather_kv(cache: torch.Tensor, block_table: torch.Tensor, seq_len: int) -> torch.Tensor:
    """[seq_len, num_kv_heads, head_dim] of one sequence, read through its block table."""
    block_size = cache.shape[1]
    num_blocks = (seq_len + block_size - 1) // block_size
    if is_fp8(cache):  # gathered as bytes (see write_kv), read back as e4m3
        return cache.view(torch.uint8)[block_table[:num_blocks].long()].flatten(0, 1)[:seq_len].view(cache.dtype)
    return cache[block_table[:num_blocks].long()].flatten(0, 1)[:seq_len]


def paged_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    meta: AttentionMetadata, scale: float, k_scale: torch.Tensor | None = None,
                    v_scale: torch.Tensor | None = None, out: torch.Tensor | None = None,
                    window: int = 0, softcap: float = 0.0) -> torch.Tensor:
    """Causal attention of each sequence's new tokens over its whole paged context.

    query: [num_tokens, num_heads, head_dim]; returns the same shape (in `out` when given). Query
    token j of a sequence with q new tokens and context L sits at position L - q + j and sees
    positions <= its own; window > 0 (a sliding window, HF's mask): only those > its own - window.
    softcap > 0: scores (after the scale) become softcap * tanh(score / softcap), Gemma 2's.
    An fp8 pool is read as stored * k_scale (v_scale).
    """
    if meta.unified_capacity is not None:
        result = static_paged_attention(query, k_cache, v_cache, meta, scale, k_scale, v_scale, window, softcap)
        return result if out is None else out.copy_(result)
    out = torch.empty_like(query) if out is None else out
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
        scores = _softcap(torch.einsum("qhd,khd->hqk", q, k) * scale, softcap)  # [H, q, L]
        q_pos = torch.arange(seq_len - (hi - lo), seq_len, device=query.device)
        k_pos = torch.arange(seq_len, device=query.device)
        hidden = k_pos[None, :] > q_pos[:, None]
        if window > 0:
            hidden |= k_pos[None, :] <= q_pos[:, None] - window
        scores.masked_fill_(hidden[None], float("-inf"))
        probs = scores.softmax(dim=-1)
        out[lo:hi] = torch.einsum("hqk,khd->qhd", probs, v).to(query.dtype)
    return out


def static_paged_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           meta: AttentionMetadata, scale: float, k_scale: torch.Tensor | None = None,
                           v_scale: torch.Tensor | None = None, window: int = 0,
                           softcap: float = 0.0) -> torch.Tensor:
    """paged_attention with shapes fixed by the tensors' shapes alone, never by their values (no
    host copy, no per-sequence loop): the CPU stand-in for the unified kernel inside a full graph.
    Every token row reads its sequence's whole block-table width, masked to positions <= its own;
    rows outside every sequence (a bucket's padding) attend to nothing and come out zero. window > 0:
    a sliding window, softcap > 0 soft-capped scores, as paged_attention's."""
    T, num_heads, _ = query.shape
    num_kv_heads, block_size = k_cache.shape[2], k_cache.shape[1]
    qsl = meta.query_start_loc.long()
    seq_lens = meta.seq_lens.long()
    tok = torch.arange(T, device=query.device)
    seq = torch.searchsorted(qsl[1:], tok, right=True).clamp(max=seq_lens.shape[0] - 1)
    valid = tok < qsl[-1]
    pos = seq_lens[seq] - (qsl[seq + 1] - qsl[seq]) + (tok - qsl[seq])
    width = meta.block_tables.shape[1]
    kpos = torch.arange(width * block_size, device=query.device)
    blocks = meta.block_tables.long()[seq][:, kpos // block_size]          # [T, L]
    offsets = (kpos % block_size).expand_as(blocks)
    group = num_heads // num_kv_heads
    k = dequantize_kv(k_cache[blocks, offsets] if not is_fp8(k_cache) else
                      k_cache.view(torch.uint8)[blocks, offsets].view(k_cache.dtype), k_scale)
    v = dequantize_kv(v_cache[blocks, offsets] if not is_fp8(v_cache) else
                      v_cache.view(torch.uint8)[blocks, offsets].view(v_cache.dtype), v_scale)
    k = k.repeat_interleave(group, dim=2)                                  # [T, L, H, D]
    v = v.repeat_interleave(group, dim=2)
    scores = _softcap(torch.einsum("thd,tlhd->thl", query.float(), k) * scale, softcap)
    seen = (kpos[None, :] <= pos[:, None]) & valid[:, None]
    if window > 0:
        seen &= kpos[None, :] > pos[:, None] - window
    scores = scores.masked_fill(~seen[:, None, :], float("-inf"))
    probs = torch.nan_to_num(scores.softmax(dim=-1), nan=0.0)
    return torch.einsum("thl,tlhd->thd", probs, v).to(query.dtype)


def _softcap(scores: torch.Tensor, cap: float) -> torch.Tensor:
    return torch.tanh(scores / cap) * cap if cap > 0 else scores


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
