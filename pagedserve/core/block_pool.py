"""BlockPool: the physical blocks of one device (or of the CPU swap space).

Every block is in exactly one state:
  free         ref_cnt == 0, in the free queue, block_hash None
  cached-free  ref_cnt == 0, in the free queue, block_hash registered (reusable on a prefix hit)
  owned        ref_cnt >= 1, not in the free queue (block_hash may be set: a shared, full block)
A block's hash leaves the hash map only when the block is handed out again (evicted),
so freeing keeps the content findable until the memory is actually needed.
"""
from __future__ import annotations

import hashlib
from array import array
from typing import Iterable, Sequence as Seq

from pagedserve.core.free_queue import FreeKVCacheBlockQueue, KVCacheBlock, PoolBlocks

# Each block's state as one ASCII letter (the dashboard's snapshot, core/kv_state.py): free, used
# (ref_cnt 1), shared (ref_cnt > 1), cached (free, hash registered). BlockPool.codes is kept up to
# date where ref_cnt and the hash change, so a snapshot copies num_blocks bytes instead of reading
# 65,536 block objects on the engine thread (1.3 ms on our CPU; one byte store per block here).
FREE, USED, SHARED, CACHED = b"fusc"
RESERVED = ord("r")  # the contiguous allocators' reserved-but-unwritten blocks (core/contiguous.py)


def hash_block_tokens(parent_hash: bytes | None, token_ids: Seq[int]) -> bytes:
    """Content hash of a full block, chained over its prefix so equal hashes mean equal prefixes.

    sha256 rather than Python's hash(): a collision would silently serve another prompt's KV.
    The ids go in as fixed-width int64 (no separator needed; 2.6x faster than joining their
    decimal strings, which admitting a thousand cached prompts at once paid for).
    """
    h = hashlib.sha256(parent_hash or b"")
    h.update(array("q", token_ids))
    return h.digest()


def cache_salt_root(salt: str | None) -> bytes | None:
    """The parent hash of a request's first block under vLLM's cache_salt: requests share cached
    blocks only with requests of the same salt (None: the unsalted chain everyone shares)."""
    return None if salt is None else hashlib.sha256(b"pagedserve-cache-salt\0" + salt.encode()).digest()


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks < 0:
            raise ValueError(f"num_blocks must be >= 0, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.free_block_queue = FreeKVCacheBlockQueue.fresh(num_blocks)
        self.blocks = PoolBlocks(self.free_block_queue)  # by id; each made when first reached
        self.cached_block_hash_to_block: dict[bytes, KVCacheBlock] = {}
        self.num_cached_free = 0  # free blocks that still hold a registered hash
        self.codes = bytearray([FREE]) * num_blocks  # by block id, see FREE..CACHED

    def get_num_free_blocks(self) -> int:
        """Blocks an allocation can take: free plus cached-free."""
        return self.free_block_queue.num_free_blocks

    def get_num_used_blocks(self) -> int:
        return self.num_blocks - self.free_block_queue.num_free_blocks

    def get_new_blocks(self, n: int) -> list[KVCacheBlock]:
        """Pop n blocks from the LRU end, evicting their cached content, each with ref_cnt 1."""
        if n > self.get_num_free_blocks():
            raise ValueError(f"cannot allocate {n} blocks: only {self.get_num_free_blocks()} free")
        out = []
        for _ in range(n):
            block = self.free_block_queue.popleft()
            if block.block_hash is not None:
                self._evict(block)
            block.ref_cnt = 1
            self.codes[block.block_id] = USED
            out.append(block)
        return out

    def _evict(self, block: KVCacheBlock) -> None:
        if self.cached_block_hash_to_block.get(block.block_hash) is block:
            del self.cached_block_hash_to_block[block.block_hash]
        block.block_hash = None
        self.num_cached_free -= 1

    def get_cached_block(self, block_hash: bytes) -> KVCacheBlock | None:
        if not self.enable_caching:
            return None
        return self.cached_block_hash_to_block.get(block_hash)

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take a reference on blocks found by a prefix hit, reviving cached-free ones."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_block_queue.remove(block)
                self.num_cached_free -= 1
            block.ref_cnt += 1
            self.codes[block.block_id] = USED if block.ref_cnt == 1 else SHARED

    def incr_ref(self, blocks: Iterable[KVCacheBlock]) -> None:
        for block in blocks:
            if block.ref_cnt < 1:
                raise ValueError(f"block {block.block_id} is not owned")
            block.ref_cnt += 1
            self.codes[block.block_id] = SHARED

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference each; blocks reaching 0 join the tail of the queue in the given order.

        Callers pass a table reversed, so a sequence's last blocks are evicted before its prefix.
        """
        for block in ordered_blocks:
            if block.ref_cnt < 1:
                raise ValueError(f"double free of block {block.block_id}")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_block_queue.append(block)
                if block.block_hash is not None:
                    self.num_cached_free += 1
                self.codes[block.block_id] = FREE if block.block_hash is None else CACHED
            else:
                self.codes[block.block_id] = USED if block.ref_cnt == 1 else SHARED

    def return_unused(self, blocks: Seq[KVCacheBlock]) -> None:
        """Give back blocks just taken by get_new_blocks and never filled with anything kept (a
        speculative step's rejected lookahead): each goes back to the head of the free queue, in
        the order they were taken, so the queue is as if they had never left it."""
        for block in reversed(blocks):
            if block.ref_cnt != 1 or block.block_hash is not None:
                raise ValueError(f"block {block.block_id} is shared or cached: not an unused lookahead block")
            block.ref_cnt = 0
            self.free_block_queue.appendleft(block)
            self.codes[block.block_id] = FREE

    def cache_full_block(self, block: KVCacheBlock, block_hash: bytes) -> bool:
        """Register an owned, full block under its content hash. False if caching is off or
        another block already holds this content (the first one stays canonical)."""
        if not self.enable_caching or block.block_hash is not None:
            return False
        if block_hash in self.cached_block_hash_to_block:
            return False
        block.block_hash = block_hash
        self.cached_block_hash_to_block[block_hash] = block
        return True

    def reset_prefix_cache(self) -> bool:
        """Forget every cached-free block's content; False if some block is still owned."""
        if self.get_num_used_blocks() != 0:
            return False
        for block in self.blocks.made():  # a block never made never held a hash
            block.block_hash = None
        self.cached_block_hash_to_block.clear()
        self.num_cached_free = 0
        self.codes[:] = bytes([FREE]) * self.num_blocks
        return True
