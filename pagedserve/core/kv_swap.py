"""KVSwap: a group's block tables between the device pool and the CPU pool, for preemption by
swap (core/preemption.py). A mixin of KVCacheManager, whose tables, pools and table log it moves:
a block shared inside the group moves once and stays shared; entries a sliding window freed
(None) stay None, with nothing to move.
"""
from __future__ import annotations

from typing import Iterable

from pagedserve.core.block_pool import BlockPool
from pagedserve.core.free_queue import KVCacheBlock
from pagedserve.sequence import Sequence, SequenceGroup


def block_ids_of(table: list[KVCacheBlock | None]) -> list[int]:
    """Block ids of a table; an entry freed past the window reads block 0 (never unmasked)."""
    return [0 if b is None else b.block_id for b in table]


class KVSwap:
    """Mixin of KVCacheManager (core/kv_cache_manager.py)."""

    def _distinct(self, tables: Iterable[list[KVCacheBlock]]) -> dict[int, KVCacheBlock]:
        out: dict[int, KVCacheBlock] = {}
        for t in tables:
            for b in t:
                if b is not None:
                    out.setdefault(b.block_id, b)
        return out

    def _group_seqs(self, group: SequenceGroup, tables: dict) -> list[Sequence]:
        return [s for s in group.unfinished_seqs() if s.seq_id in tables]

    def can_swap_out(self, group: SequenceGroup) -> bool:
        seqs = self._group_seqs(group, self.block_tables)
        n = len(self._distinct(self.block_tables[s.seq_id] for s in seqs))
        return n <= self.cpu_pool.get_num_free_blocks()

    def swap_out(self, group: SequenceGroup) -> list[tuple[int, int]]:
        """Move the group's device blocks to CPU blocks; a block shared in the group moves once."""
        for seq in self._group_seqs(group, self.block_tables):
            del self._block_ids[seq.seq_id]
            if self.table_log is not None:
                self.table_log.removed(seq.seq_id)
        return self._move(group, self.block_tables, self.cpu_block_tables, self.pool, self.cpu_pool)

    def can_swap_in(self, group: SequenceGroup) -> bool:
        seqs = self._group_seqs(group, self.cpu_block_tables)
        n = len(self._distinct(self.cpu_block_tables[s.seq_id] for s in seqs))
        # One spare block per seq for its next token (or a copy-on-write) right after,
        # unless the cache is empty: then it comes back anyway and grows as far as it can.
        free = self.get_num_free_blocks()
        return n + len(seqs) <= free - self.watermark_blocks or (n <= free and not self.block_tables)

    def swap_in(self, group: SequenceGroup) -> list[tuple[int, int]]:
        mapping = self._move(group, self.cpu_block_tables, self.block_tables, self.cpu_pool, self.pool)
        for seq in self._group_seqs(group, self.block_tables):
            self._block_ids[seq.seq_id] = block_ids_of(self.block_tables[seq.seq_id])
            if self.table_log is not None:
                self.table_log.replaced(seq.seq_id)
            self._num_cached_blocks[seq.seq_id] = 0
            self.cache_blocks(seq)
        self._note_usage()
        return mapping

    @staticmethod
    def _move(group, src_tables, dst_tables, src_pool: BlockPool, dst_pool: BlockPool) -> list[tuple[int, int]]:
        mapping: dict[int, KVCacheBlock] = {}
        seqs = [s for s in group.unfinished_seqs() if s.seq_id in src_tables]
        for seq in seqs:
            new_table = []
            for b in src_tables[seq.seq_id]:
                if b is None:  # freed past the window: nothing to move
                    new_table.append(None)
                    continue
                if b.block_id in mapping:
                    dst_pool.incr_ref([mapping[b.block_id]])
                else:
                    mapping[b.block_id] = dst_pool.get_new_blocks(1)[0]
                new_table.append(mapping[b.block_id])
            dst_tables[seq.seq_id] = new_table
        for seq in seqs:
            src_pool.free_blocks(b for b in reversed(src_tables.pop(seq.seq_id)) if b is not None)
        return [(src, dst.block_id) for src, dst in mapping.items()]

