"""KVCacheManager: per-sequence block tables over a device BlockPool (and a CPU pool for swap).

Invariants kept here (and checked by tests/core):
- sum of ref counts of device blocks == number of device block-table entries that hold a block;
- a sequence's table covers exactly ceil(slots / block_size) blocks, where slots is the
  number of tokens allocated for it (all known tokens at admission, then one per decode);
  the blocks admission takes past a prefix hit are the free queue's first, in ascending id order;
- a block written this step has ref_cnt 1: a shared block in the write range is first
  copied (copy-on-write) and the (src, dst) pair is returned for the runner;
- only full blocks of computed tokens carry a content hash, so a hashed block is never written;
- speculative lookahead (append_slots' num_lookahead_tokens): slots for k unverified tokens are
  allocated like any others, and free_rejected_slots, once the runner has verified them, gives
  back every block the lookahead added that holds no verified token, to the head of the free
  queue as if it had never been taken. Unverified tokens are never hashed: hashes cover
  min(computed, known) tokens, and a proposed token is neither known (it is not in the
  sequence's token ids) nor counted computed after the rollback. What a lookahead cannot undo:
  a cached-free block it took was evicted (as any allocation evicts).
- sliding_window w > 0 (every layer attends to its last w positions only): before a sequence's
  slots are appended, the blocks wholly before its window, index < (computed - w + 1) // block_size,
  go back to the pool (cached-free where hashed, so a later prompt can still reuse them) and their
  entries become None. Its block ids (block_table_view) keep the old ids there: the kernels read
  those positions only under the window's mask, and every block holds finite values (the device
  pool starts zeroed, every write is finite), so p = 0 times whatever is there adds nothing.
"""
from __future__ import annotations

import enum
from operator import attrgetter
from typing import Iterable

from pagedserve.core.block_pool import BlockPool, cache_salt_root, hash_block_tokens
from pagedserve.core.free_queue import KVCacheBlock
from pagedserve.core.kv_swap import KVSwap, block_ids_of
from pagedserve.core.stats import MemoryBreakdown, SeqKVLayout, breakdown_from_tables
from pagedserve.core.table_log import TableChangeLog
from pagedserve.sequence import Sequence, SequenceGroup, SequenceStatus


class AllocStatus(enum.Enum):
    OK = "ok"
    LATER = "later"   # not now: wait for blocks to be freed
    NEVER = "never"   # larger than the whole device cache


_block_id = attrgetter("block_id")


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager(KVSwap):
    supports_swap = True
    supports_fork = True

    def __init__(self, block_size: int, num_gpu_blocks: int, num_cpu_blocks: int = 0,
                 enable_prefix_caching: bool = True, watermark: float = 0.01, sliding_window: int = 0) -> None:
        self.block_size = block_size
        self.sliding_window = sliding_window
        # seq_id -> how many leading entries of its table the window has freed (None entries)
        self._window_freed: dict[int, int] = {}
        self.num_gpu_blocks = num_gpu_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_gpu_blocks, enable_caching=enable_prefix_caching)
        self.cpu_pool = BlockPool(num_cpu_blocks, enable_caching=False)
        # Admission keeps this many blocks spare so running sequences can grow a little first.
        self.watermark_blocks = int(watermark * num_gpu_blocks)
        self.block_tables: dict[int, list[KVCacheBlock | None]] = {}
        # The same device tables as block ids, kept in step with block_tables so the scheduler
        # hands the runner a table without rebuilding it (O(1) per sequence per step).
        self._block_ids: dict[int, list[int]] = {}
        self.cpu_block_tables: dict[int, list[KVCacheBlock]] = {}
        self._seqs: dict[int, Sequence] = {}
        self._block_hashes: dict[int, list[bytes]] = {}
        self._num_cached_blocks: dict[int, int] = {}
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        self.peak_blocks_used = 0
        # Off unless a runner keeps tables on the device (Scheduler.enable_table_log).
        self.table_log: TableChangeLog | None = None
        # seq_id -> its table's length before a lookahead append, until free_rejected_slots.
        self._lookahead_from: dict[int, int] = {}

    # ---- queries -------------------------------------------------------------------
    def get_block_table(self, seq: Sequence) -> list[int]:
        """A copy of the seq's device block ids: the blocks it holds (entries a sliding window freed
        are left out; block_table_view, what the kernels read, keeps them)."""
        if self._window_freed.get(seq.seq_id):
            return [b.block_id for b in self.block_tables[seq.seq_id] if b is not None]
        return list(self._block_ids[seq.seq_id])

    def block_table_view(self, seq: Sequence) -> list[int]:
        """The seq's live device block ids (no copy): valid until the table next changes,
        i.e. for the rest of the step it was scheduled in. Callers must not modify it."""
        return self._block_ids[seq.seq_id]

    def _set_table(self, sid: int, table: list[KVCacheBlock]) -> None:
        self.block_tables[sid] = table
        self._block_ids[sid] = block_ids_of(table)
        if self.table_log is not None:
            self.table_log.replaced(sid)

    def enable_table_log(self) -> TableChangeLog:
        """Record every change to a device table from now on (tables that exist count as new)."""
        self.table_log = TableChangeLog(self._block_ids)
        return self.table_log

    def table_ids(self, seq_id: int) -> list[int]:
        """The live device block ids of a sequence by id (the table log reads changes through it)."""
        return self._block_ids[seq_id]

    def get_num_free_blocks(self) -> int:
        return self.pool.get_num_free_blocks()

    def has_table(self, seq: Sequence) -> bool:
        return seq.seq_id in self.block_tables

    def _hashes(self, seq: Sequence, num_blocks: int) -> list[bytes]:
        """Content hashes of the first num_blocks full blocks of seq, computed once."""
        hashes = self._block_hashes.setdefault(seq.seq_id, [])
        if len(hashes) < num_blocks:
            bs = self.block_size
            for i in range(len(hashes), num_blocks):
                block = seq.token_slice(i * bs, (i + 1) * bs)
                hashes.append(hash_block_tokens(hashes[-1] if hashes else cache_salt_root(seq.cache_salt), block))
        return hashes

    def _find_cached_prefix(self, seq: Sequence) -> list[KVCacheBlock]:
        """Longest run of cached full blocks that prefixes seq, leaving >= 1 token to compute."""
        if not self.enable_prefix_caching or not seq.reads_prefix_cache:
            return []
        max_hits = (seq.num_tokens - 1) // self.block_size
        hits: list[KVCacheBlock] = []
        for h in self._hashes(seq, max_hits):
            block = self.pool.get_cached_block(h)
            if block is None:
                break
            hits.append(block)
        return hits

    # ---- admission -----------------------------------------------------------------
    def _blocks_to_admit(self, group: SequenceGroup) -> tuple[int, int]:
        """(blocks the group's waiting seqs occupy in all, free-queue blocks that takes now)."""
        total, needed, revived = 0, 0, set()
        for seq in group.seqs_with_status(SequenceStatus.WAITING):
            hits = self._find_cached_prefix(seq)
            nb = cdiv(seq.num_tokens, self.block_size)
            total += nb
            needed += nb - len(hits)
            revived.update(b.block_id for b in hits if b.ref_cnt == 0)
        return total, needed + len(revived)

    def can_allocate(self, group: SequenceGroup) -> AllocStatus:
        total, needed = self._blocks_to_admit(group)
        free = self.get_num_free_blocks()
        if total > self.num_gpu_blocks:
            return AllocStatus.NEVER
        fork_reserve = 0
        if len(group.seqs) == 1 and not group.seqs[0].output_token_ids:
            # The prompt will fork into best_of sequences: keep a block for each child's first write.
            fork_reserve = (group.sampling_params.best_of or 1) - 1
        if needed + fork_reserve <= free - self.watermark_blocks:
            return AllocStatus.OK
        if needed <= free and not self.block_tables:
            # The cache is idle: admit what fits now rather than wait for a margin that never comes.
            return AllocStatus.OK
        return AllocStatus.LATER

    def allocate(self, group: SequenceGroup) -> None:
        """Give every waiting seq of the group a table for all its known tokens.

        Reuses the longest cached prefix and sets seq.num_computed_tokens to the tokens reused.
        """
        for seq in group.seqs_with_status(SequenceStatus.WAITING):
            if seq.seq_id in self.block_tables:
                raise ValueError(f"seq {seq.seq_id} already has a block table")
            hits = self._find_cached_prefix(seq)
            self.pool.touch(hits)
            new = self.pool.get_new_blocks(cdiv(seq.num_tokens, self.block_size) - len(hits))
            # In id order: blocks freed together come back as a reversed table, and a prompt that
            # takes them then holds one run of the pool again, which long prefills read in place
            # (attention/gathered_prefill.py). Which blocks are taken (the LRU's) is unchanged.
            new.sort(key=_block_id)
            self._set_table(seq.seq_id, hits + new)
            self._seqs[seq.seq_id] = seq
            self._num_cached_blocks[seq.seq_id] = len(hits)
            seq.num_computed_tokens = len(hits) * self.block_size
            self.prefix_cache_queries += seq.num_tokens if self.enable_prefix_caching else 0
            self.prefix_cache_hits += seq.num_computed_tokens
        self._note_usage()

    # ---- growth and copy-on-write -------------------------------------------------------
    def _write_range(self, seq: Sequence, num_new_tokens: int) -> range:
        bs = self.block_size
        start = seq.num_computed_tokens
        return range(start // bs, cdiv(start + num_new_tokens, bs))

    def _blocks_needed(self, seq: Sequence, num_new_tokens: int) -> int:
        table = self.block_tables[seq.seq_id]
        bs = self.block_size
        start = seq.num_computed_tokens
        if num_new_tokens == 1:  # a decode: one slot, in a new block or in the last one
            i = start // bs
            return 1 if i >= len(table) or table[i].ref_cnt > 1 else 0
        first, stop = start // bs, cdiv(start + num_new_tokens, bs)
        n = len(table)
        grow = stop - n if stop > n else 0
        cow = 0
        for i in range(first, min(stop, n)):
            if table[i].ref_cnt > 1:
                cow += 1
        return grow + cow

    def can_append_slots(self, seqs: Iterable[tuple[Sequence, int]], reserve: int = 0) -> bool:
        """Whether every (seq, num_new_tokens) can get slots (new blocks and COW copies) now,
        leaving `reserve` blocks free."""
        needed = reserve
        for s, n in seqs:
            needed += self._blocks_needed(s, n)
        return needed <= self.pool.free_block_queue.num_free_blocks

    def exceeds_capacity(self, group: SequenceGroup, seqs: Iterable[tuple[Sequence, int]]) -> bool:
        """Whether the group would need more blocks than the whole device cache to take this step."""
        needed = 0
        for s, n in seqs:
            needed += self._blocks_needed(s, n)
        if len(group.seqs) == 1:
            seq = group.seqs[0]
            table = self.block_tables.get(seq.seq_id)
            own = len(table) if table is not None and not seq.status.finished else 0
            return own + needed > self.num_gpu_blocks
        tables = [self.block_tables[s.seq_id] for s in self._group_seqs(group, self.block_tables)]
        # Entries bound distinct blocks from above: only count distinct ones when that bound is too big.
        if sum(len(t) for t in tables) + needed <= self.num_gpu_blocks:
            return False
        return len(self._distinct(tables)) + needed > self.num_gpu_blocks

    def append_decode_slots(self, seqs: list[Sequence]) -> list[tuple[int, int]] | None:
        """One slot each for running single-sequence decodes, all or nothing.

        None (nothing changed) when the blocks they need together exceed the free ones, or one
        alone would outgrow the whole cache; then the caller takes the per-group path. Otherwise
        the COW (src, dst) pairs. Needs are counted before any append: a copy-on-write only
        lowers the ref_cnt of a shared block, so the sum bounds what the appends really take.
        """
        bs = self.block_size
        tables = self.block_tables
        cap = self.num_gpu_blocks
        if self.sliding_window:
            for s in seqs:
                self.free_past_window(s)
        grow: list[Sequence] = []
        for s in seqs:
            table = tables[s.seq_id]
            i = s.num_computed_tokens // bs
            n = len(table)
            if i < n and table[i].ref_cnt == 1:
                continue  # room in an unshared block: the common case
            if i > n or n + 1 > cap:
                return None
            grow.append(s)
        if len(grow) > self.pool.free_block_queue.num_free_blocks:
            return None
        copies: list[tuple[int, int]] = []
        for s in grow:
            copies.extend(self.append_slots(s, 1))
        return copies

    def append_slots(self, seq: Sequence, num_new_tokens: int,
                     num_lookahead_tokens: int = 0) -> list[tuple[int, int]]:
        """Make slots [num_computed, num_computed + n + lookahead) writable; returns COW (src, dst)
        pairs. The last num_lookahead_tokens slots hold proposed, unverified tokens: after the
        step, free_rejected_slots gives back what they needed beyond the verified ones."""
        if self.sliding_window:
            self.free_past_window(seq)
        if num_lookahead_tokens:
            self._lookahead_from[seq.seq_id] = len(self.block_tables[seq.seq_id])
            num_new_tokens += num_lookahead_tokens
        table = self.block_tables[seq.seq_id]
        ids = self._block_ids[seq.seq_id]
        log = self.table_log
        if num_new_tokens == 1:
            i = seq.num_computed_tokens // self.block_size
            if i == len(table):  # the decode opens a new block
                block = self.pool.get_new_blocks(1)[0]
                table.append(block)
                ids.append(block.block_id)
                if log is not None:
                    log.changed(seq.seq_id, i)
                self._note_usage()
                return []
            if i < len(table) and table[i].ref_cnt == 1:  # room in an unshared last block
                return []
        rng = self._write_range(seq, num_new_tokens)
        copies = []
        for i in range(rng.start, min(rng.stop, len(table))):
            if table[i].ref_cnt > 1:
                old = table[i]
                table[i] = self.pool.get_new_blocks(1)[0]
                ids[i] = table[i].block_id
                self.pool.free_blocks([old])
                copies.append((old.block_id, table[i].block_id))
                if log is not None:
                    log.changed(seq.seq_id, i)
        if rng.stop > len(table):
            if log is not None:
                log.changed(seq.seq_id, len(table))
            new = self.pool.get_new_blocks(rng.stop - len(table))
            table.extend(new)
            ids.extend(b.block_id for b in new)
            self._note_usage()
        elif copies:
            self._note_usage()
        return copies

    def free_past_window(self, seq: Sequence) -> None:
        """Give back the blocks wholly before the seq's window (see the module docstring): the
        positions its next computed token can see start at num_computed - sliding_window + 1."""
        sid = seq.seq_id
        start = max(0, seq.num_computed_tokens - self.sliding_window + 1) // self.block_size
        done = self._window_freed.get(sid, 0)
        if start <= done:
            return
        table = self.block_tables[sid]
        gone = [b for b in table[done:start] if b is not None]
        table[done:start] = [None] * (start - done)
        self._window_freed[sid] = start
        self.pool.free_blocks(reversed(gone))  # the prefix last into the queue: evicted last

    def free_rejected_slots(self, seq: Sequence) -> None:
        """After a lookahead step, with seq.num_computed_tokens already counting only the verified
        tokens: the blocks the lookahead added past those go back to the pool (head of the free
        queue, in order); the table is then what appending the verified tokens alone gives.
        Entries past a table's length are never read, so the table log records nothing."""
        before = self._lookahead_from.pop(seq.seq_id, None)
        table = self.block_tables.get(seq.seq_id)
        if before is None or table is None:
            return
        keep = max(before, cdiv(seq.num_computed_tokens, self.block_size))
        if keep < len(table):
            extra = table[keep:]
            del table[keep:]
            del self._block_ids[seq.seq_id][keep:]
            self.pool.return_unused(extra)

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """The child shares every block of the parent; writes are copied on demand."""
        table = self.block_tables[parent.seq_id]
        self.pool.incr_ref(b for b in table if b is not None)
        self._set_table(child.seq_id, list(table))
        if parent.seq_id in self._window_freed:
            self._window_freed[child.seq_id] = self._window_freed[parent.seq_id]
        self._seqs[child.seq_id] = child
        self._block_hashes[child.seq_id] = list(self._block_hashes.get(parent.seq_id, []))
        self._num_cached_blocks[child.seq_id] = self._num_cached_blocks.get(parent.seq_id, 0)

    def cache_blocks(self, seq: Sequence) -> None:
        """Register blocks that became full of computed tokens, so later requests can reuse them."""
        if not self.enable_prefix_caching:
            return
        table = self.block_tables.get(seq.seq_id)
        if table is None:
            return
        # Only blocks whose tokens the host knows: a computed placeholder has no content hash yet.
        full = min(min(seq.num_computed_tokens, seq.num_known_tokens) // self.block_size, len(table))
        done = self._num_cached_blocks.get(seq.seq_id, 0)
        if full <= done:
            return
        hashes = self._hashes(seq, full)
        for i in range(done, full):
            if table[i] is not None:  # None: freed past the window before it was cached
                self.pool.cache_full_block(table[i], hashes[i])
        self._num_cached_blocks[seq.seq_id] = full

    # ---- release -------------------------------------------------------------------
    def free(self, seq: Sequence) -> None:
        """Release the seq's device or CPU blocks; the tail goes first into the eviction queue."""
        sid = seq.seq_id
        if sid in self.block_tables:
            self.pool.free_blocks(b for b in reversed(self.block_tables.pop(sid)) if b is not None)
            del self._block_ids[sid]
            if self.table_log is not None:
                self.table_log.removed(sid)
        if sid in self.cpu_block_tables:
            self.cpu_pool.free_blocks(reversed(self.cpu_block_tables.pop(sid)))
        self._seqs.pop(sid, None)
        self._lookahead_from.pop(sid, None)
        self._window_freed.pop(sid, None)
        self._block_hashes.pop(sid, None)
        self._num_cached_blocks.pop(sid, None)

    def reset_prefix_cache(self) -> bool:
        return self.pool.reset_prefix_cache()

    # ---- statistics -------------------------------------------------------------------
    def _note_usage(self) -> None:
        self.peak_blocks_used = max(self.peak_blocks_used, self.pool.get_num_used_blocks())

    def num_allocated_slots(self) -> int:
        return self.pool.get_num_used_blocks() * self.block_size

    def num_swapped_blocks(self) -> int:
        return self.cpu_pool.get_num_used_blocks()

    def num_cached_free_blocks(self) -> int:
        return self.pool.num_cached_free

    def block_states(self) -> str:
        """Each device block's state, by block id, one letter each (core/kv_state.py's STATE_CODES):
        free, used (ref 1), shared (ref > 1) or cached (free but holding reusable prefix content).
        A copy of what the pool keeps up to date: O(blocks) bytes, no Python loop."""
        return self.pool.codes.decode("ascii")

    def cpu_block_states(self) -> tuple[int, dict[int, str]]:
        """(CPU blocks in all, {block id: used | shared} for the swapped-out ones); every other
        CPU block is free. Sparse because swap space often has far more blocks than the device."""
        owned = self._distinct(self.cpu_block_tables.values())
        return self.cpu_pool.num_blocks, {i: "shared" if b.ref_cnt > 1 else "used" for i, b in owned.items()}

    def cpu_block_table(self, seq: Sequence) -> list[int] | None:
        """The seq's CPU block ids while it is swapped out, else None."""
        table = self.cpu_block_tables.get(seq.seq_id)
        return None if table is None else block_ids_of(table)

    def seq_layouts(self) -> list[SeqKVLayout]:
        """A snapshot of every device block table (for figures and sharing counts)."""
        out = []
        for sid, t in self.block_tables.items():
            gone = self._window_freed.get(sid, 0) * self.block_size  # tokens whose blocks went back
            out.append(SeqKVLayout(sid, [b.block_id for b in t if b is not None],
                                   self._seqs[sid].num_computed_tokens - gone, self._seqs[sid].num_tokens - gone))
        return out

    def memory_breakdown(self, waiting_head: SequenceGroup | None = None) -> MemoryBreakdown:
        """Paged: slots of known-but-uncomputed tokens are reserved, the rest of a block is
        internal fragmentation; free blocks are always usable, so no external fragmentation."""
        entries = [(layout.block_ids, layout.num_computed_tokens, layout.horizon,
                    any(b is not None and b.ref_cnt > 1 for b in self.block_tables[layout.seq_id]))
                   for layout in self.seq_layouts()]
        return breakdown_from_tables(entries, self.block_size)
