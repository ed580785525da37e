"""KV-cache statistics and the paper's Figure-2 breakdown of occupied KV memory.

Counts are in token slots (one slot = the K and V of one token in every layer).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Sequence


@dataclass
class KVCacheStats:
    """A snapshot of the device KV cache.

    num_blocks_used + num_blocks_free == num_blocks_total; num_blocks_cached counts the
    free blocks that still hold reusable prefix content (a subset of num_blocks_free).
    prefix_cache_* are in tokens: queries = prompt tokens looked up, hits = tokens reused.
    num_live_tokens is None when the stats were taken with token_counts=False (counting live
    tokens walks every block table; every other field is O(1) to read).
    """
    block_size: int
    num_blocks_total: int
    num_blocks_free: int
    num_blocks_cached: int
    num_blocks_used: int
    peak_blocks_used: int
    num_live_tokens: int | None   # physical slots holding computed KV (shared slots once)
    num_allocated_slots: int      # slots owned by some request (contiguous: whole reservations)
    num_swapped_blocks: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_preemptions: int
    cache_dtype: str = "auto"     # the device pools' element type (fp8_e4m3: twice the blocks of bf16)

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0

    @property
    def usage(self) -> float:
        """Fraction of device blocks owned by requests (vLLM's kv_cache_usage_perc)."""
        return self.num_blocks_used / self.num_blocks_total if self.num_blocks_total else 0.0

    @property
    def utilization(self) -> float:
        """Share of allocated slots that hold live token states."""
        if self.num_live_tokens is None:
            raise ValueError("utilization needs num_live_tokens: take the stats with token_counts=True")
        return self.num_live_tokens / self.num_allocated_slots if self.num_allocated_slots else 0.0


@dataclass
class SeqKVLayout:
    """Where one sequence's KV lives: its block ids in table order (contiguous: its reserved run),
    how many tokens are computed, and how many it will certainly hold (the breakdown's horizon)."""
    seq_id: int
    block_ids: list[int]
    num_computed_tokens: int
    horizon: int


@dataclass
class MemoryBreakdown:
    """Occupied KV memory split as in the paper's Figure 2, in token slots.

    token_states      slots holding computed KV
    reserved          slots that this request is certain to fill later (contiguous: up to its
                      final length; paged: known tokens allocated but not yet computed)
    internal_fragmentation  owned slots that will never hold a token (contiguous: beyond the
                      final length; paged: the unused tail of the last block)
    external_fragmentation  free slots that cannot be used: free blocks in holes too small
                      for the request waiting at the head of the queue (always 0 for paged)
    """
    token_states: int = 0
    reserved: int = 0
    internal_fragmentation: int = 0
    external_fragmentation: int = 0

    @property
    def total(self) -> int:
        return self.token_states + self.reserved + self.internal_fragmentation + self.external_fragmentation

    def fractions(self) -> dict[str, float]:
        t = self.total
        keys = ("token_states", "reserved", "internal_fragmentation", "external_fragmentation")
        return {k: (getattr(self, k) / t if t else 0.0) for k in keys}


def breakdown_from_tables(entries: Iterable[tuple[Sequence[int], int, int, bool]],
                          block_size: int) -> MemoryBreakdown:
    """Split owned blocks into token states / reserved / internal fragmentation.

    entries: (block ids, computed tokens, horizon, shares blocks) per sequence; horizon is
    how many tokens the sequence will certainly hold in these blocks. A block shared by
    several sequences is counted once, with the largest fill any of them gives it.
    """
    out = MemoryBreakdown()
    live: dict[int, int] = {}
    will: dict[int, int] = {}
    for block_ids, computed, horizon, shared in entries:
        cap = len(block_ids) * block_size
        computed = min(computed, cap)
        horizon = min(max(horizon, computed), cap)
        if not shared:  # the common case, in O(1)
            out.token_states += computed
            out.reserved += horizon - computed
            out.internal_fragmentation += cap - horizon
            continue
        for i, b in enumerate(block_ids):
            lo = i * block_size
            f = min(max(computed - lo, 0), block_size)
            w = min(max(horizon - lo, 0), block_size)
            if f > live.get(b, -1):
                live[b] = f
            if w > will.get(b, -1):
                will[b] = w
    for b, f in live.items():
        w = will[b]
        out.token_states += f
        out.reserved += w - f
        out.internal_fragmentation += block_size - w
    return out
