"""Physical KV blocks and the doubly linked queue of blocks nobody owns.

The queue is ordered by eviction priority: the head is the least recently freed
block and is handed out first. Because a cached-free block can be revived by a
prefix hit, removal from the middle must be O(1): hence intrusive prev/next links
rather than a deque.
"""
from __future__ import annotations

from dataclasses import dataclass, field
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


class FreeKVCacheBlockQueue:
    """Blocks with ref_cnt == 0, LRU first. All operations are O(1)."""

    def __init__(self, blocks: Iterable[KVCacheBlock] = ()) -> None:
        self._head: KVCacheBlock | None = None
        self._tail: KVCacheBlock | None = None
        self.num_free_blocks = 0
        for b in blocks:
            self.append(b)

    def __len__(self) -> int:
        return self.num_free_blocks

    def popleft(self) -> KVCacheBlock:
        if self._head is None:
            raise ValueError("no free blocks left")
        block = self._head
        self.remove(block)
        return block

    def remove(self, block: KVCacheBlock) -> None:
        if not block.in_free_queue:
            raise ValueError(f"block {block.block_id} is not in the free queue")
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
        block.prev_free, block.next_free = None, self._head
        if self._head is None:
            self._tail = block
        else:
            self._head.prev_free = block
        self._head = block
        block.in_free_queue = True
        self.num_free_blocks += 1

    def __iter__(self) -> Iterator[KVCacheBlock]:
        cur = self._head
        while cur is not None:
            yield cur
            cur = cur.next_free

    def block_ids(self) -> list[int]:
        """Queue order, head (next to be evicted) first; for tests and debugging."""
        return [b.block_id for b in self]
