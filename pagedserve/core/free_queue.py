"""Physical KV blocks and the doubly linked queue of blocks nobody owns.

The queue is ordered by eviction priority: the head is the least recently freed
block and is handed out first. Because a cached-free block can be revived by a
prefix hit, removal from the middle must be O(1): hence intrusive prev/next links
rather than a deque.

A pool's queue starts as all its blocks in id order, and those blocks are made only when first
reached (`FreeKVCacheBlockQueue.fresh`): a tiny model's 4 GiB swap space is a million blocks, a
second and ~200 MB of objects at start-up, of which a run touches a few.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from collections.abc import Sequence
from typing import Iterable, Iterator


@dataclass(eq=False)
class KVCacheBlock:
    """One physical block. ref_cnt counts block-table entries pointing at it.

    block_hash is set only while the block holds a full block of computed tokens
    whose content hash is registered in the pool's hash map.
    """
    block_id: int
    ref_cnt: int = 0
    block_hash: bytes | None = None
    prev_free: KVCacheBlock | None = field(default=None, repr=False)
    next_free: KVCacheBlock | None = field(default=None, repr=False)
    in_free_queue: bool = field(default=False, repr=False)


# Blocks made at once when the queue's head reaches the not-yet-made ones.
MAKE_CHUNK = 256


class FreeKVCacheBlockQueue:
    """Blocks with ref_cnt == 0, LRU first. All operations are O(1) (amortized where blocks are made).

    Blocks not made yet (ids [len(made), num_total) of a `fresh` queue) have never been handed out:
    they are free, in id order, and sit in the queue right after `_anchor` (at the head when it is
    None). Making them links them in there, so the order is the one an all-made queue would have.
    """

    def __init__(self, blocks: Iterable[KVCacheBlock] = ()) -> None:
        self._head: KVCacheBlock | None = None
        self._tail: KVCacheBlock | None = None
        self.num_free_blocks = 0
        self.made: list[KVCacheBlock] = []  # a fresh queue's blocks made so far, by id
        self.num_total = 0                  # a fresh queue's blocks, made or not
        self._anchor: KVCacheBlock | None = None
        for b in blocks:
            self.append(b)

    @classmethod
    def fresh(cls, num_blocks: int) -> FreeKVCacheBlockQueue:
        """Blocks 0..num_blocks-1, all free, in id order; each made when first reached."""
        q = cls()
        q.num_total = q.num_free_blocks = num_blocks
        return q

    def block(self, block_id: int) -> KVCacheBlock:
        """A fresh queue's block by id (made, with those before it, if not yet)."""
        if not 0 <= block_id < self.num_total:
            raise IndexError(f"block id {block_id} out of range [0, {self.num_total})")
        if block_id >= len(self.made):
            self._make_through(block_id)
        return self.made[block_id]

    def _make_through(self, last_id: int) -> None:
        """Make blocks len(made)..last_id and link them in where the not-yet-made run sits."""
        prev = self._anchor
        after = self._head if prev is None else prev.next_free
        made = self.made
        for i in range(len(made), last_id + 1):
            b = KVCacheBlock(i)
            b.prev_free, b.in_free_queue = prev, True
            if prev is None:
                self._head = b
            else:
                prev.next_free = b
            made.append(b)
            prev = b
        prev.next_free = after
        if after is None:
            self._tail = prev
        else:
            after.prev_free = prev
        self._anchor = prev

    def __len__(self) -> int:
        return self.num_free_blocks

    def popleft(self) -> KVCacheBlock:
        if self._anchor is None and len(self.made) < self.num_total:  # unmade blocks come first
            self._make_through(min(self.num_total, len(self.made) + MAKE_CHUNK) - 1)
        if self._head is None:
            raise ValueError("no free blocks left")
        block = self._head
        self.remove(block)
        return block

    def remove(self, block: KVCacheBlock) -> None:
        if not block.in_free_queue:
            raise ValueError(f"block {block.block_id} is not in the free queue")
        if block is self._anchor:  # the unmade run now follows the block before it
            self._anchor = block.prev_free
        if block.prev_free is None:
            self._head = block.next_free
        else:
            block.prev_free.next_free = block.next_free
        if block.next_free is None:
            self._tail = block.prev_free
        else:
            block.next_free.prev_free = block.prev_free
        block.prev_free = block.next_free = None
        block.in_free_queue = False
        self.num_free_blocks -= 1

    def append(self, block: KVCacheBlock) -> None:
        if block.in_free_queue:
            raise ValueError(f"block {block.block_id} is already in the free queue")
        block.prev_free, block.next_free = self._tail, None
        if self._tail is None:
            self._head = block
        else:
            self._tail.next_free = block
        self._tail = block
        block.in_free_queue = True
        self.num_free_blocks += 1

    def appendleft(self, block: KVCacheBlock) -> None:
        """Put a block back at the head: it is handed out next (a block taken and never used)."""
        if block.in_free_queue:
            raise ValueError(f"block {block.block_id} is already in the free queue")
        if self._anchor is None and len(self.made) < self.num_total:  # it goes before the unmade run
            self._anchor = block
        block.prev_free, block.next_free = None, self._head
        if self._head is None:
            self._tail = block
        else:
            self._head.prev_free = block
        self._head = block
        block.in_free_queue = True
        self.num_free_blocks += 1

    def __iter__(self) -> Iterator[KVCacheBlock]:
        """Queue order; makes every block not made yet (for tests and debugging)."""
        if len(self.made) < self.num_total:
            self._make_through(self.num_total - 1)
        cur = self._head
        while cur is not None:
            yield cur
            cur = cur.next_free

    def block_ids(self) -> list[int]:
        """Queue order, head (next to be evicted) first; for tests and debugging."""
        return [b.block_id for b in self]


class PoolBlocks(Sequence):
    """A fresh queue's blocks by id, as a read-only sequence (reading one makes it)."""

    def __init__(self, queue: FreeKVCacheBlockQueue) -> None:
        self._queue = queue

    def __len__(self) -> int:
        return self._queue.num_total

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        if i < 0:
            i += len(self)
        return self._queue.block(i)

    def made(self) -> list[KVCacheBlock]:
        """The blocks made so far: all that ever left the free queue, or had state to change."""
        return self._queue.made
