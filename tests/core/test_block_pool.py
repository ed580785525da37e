"""Exact states of the block pool: ids handed out, ref counts, free-queue order, eviction."""
import pytest

from pagedserve.core.block_pool import BlockPool, hash_block_tokens
from pagedserve.core.free_queue import FreeKVCacheBlockQueue, KVCacheBlock

from core_helpers import check_pool


def test_free_queue_remove_from_middle_and_ends():
    blocks = [KVCacheBlock(i) for i in range(5)]
    q = FreeKVCacheBlockQueue(blocks)
    q.remove(blocks[2])
    q.remove(blocks[0])
    q.remove(blocks[4])
    assert q.block_ids() == [1, 3] and len(q) == 2
    q.append(blocks[2])
    assert q.block_ids() == [1, 3, 2]
    assert q.popleft() is blocks[1]
    assert q.block_ids() == [3, 2]
    with pytest.raises(ValueError):
        q.append(blocks[3])
    with pytest.raises(ValueError):
        q.remove(blocks[1])


def test_allocate_and_free_in_given_order():
    pool = BlockPool(6)
    a = pool.get_new_blocks(3)
    assert [b.block_id for b in a] == [0, 1, 2] and all(b.ref_cnt == 1 for b in a)
    assert pool.free_block_queue.block_ids() == [3, 4, 5]
    pool.free_blocks(reversed(a))
    assert pool.free_block_queue.block_ids() == [3, 4, 5, 2, 1, 0]
    check_pool(pool)
    with pytest.raises(ValueError):
        pool.free_blocks([a[0]])
    with pytest.raises(ValueError):
        pool.get_new_blocks(7)


def test_cached_block_survives_free_until_reallocated():
    pool = BlockPool(3)
    b0, b1 = pool.get_new_blocks(2)
    h = hash_block_tokens(None, [1, 2, 3, 4])
    assert pool.cache_full_block(b0, h)
    assert not pool.cache_full_block(b1, h), "the first block with a content stays canonical"
    pool.free_blocks([b1, b0])
    assert pool.free_block_queue.block_ids() == [2, 1, 0]
    assert pool.num_cached_free == 1 and pool.get_cached_block(h) is b0
    check_pool(pool)
    # A prefix hit revives it from the middle of the queue.
    pool.touch([b0])
    assert b0.ref_cnt == 1 and pool.free_block_queue.block_ids() == [2, 1] and pool.num_cached_free == 0
    pool.free_blocks([b0])
    # Eviction pops the LRU end; the hash goes only when b0 itself is handed out again.
    assert [b.block_id for b in pool.get_new_blocks(2)] == [2, 1]
    assert pool.get_cached_block(h) is b0
    (again,) = pool.get_new_blocks(1)
    assert again is b0 and b0.block_hash is None and pool.get_cached_block(h) is None
    check_pool(pool)


def test_hash_chains_over_prefix():
    h1 = hash_block_tokens(None, [1, 2])
    assert hash_block_tokens(h1, [3, 4]) != hash_block_tokens(hash_block_tokens(None, [9, 9]), [3, 4])
    assert hash_block_tokens(h1, [3, 4]) == hash_block_tokens(hash_block_tokens(None, [1, 2]), [3, 4])
    assert hash_block_tokens(None, [1, 23]) != hash_block_tokens(None, [12, 3])
    assert hash_block_tokens(None, [1, 2]) != hash_block_tokens(None, [1, 2, 0])
    assert hash_block_tokens(None, (5, 6)) == hash_block_tokens(None, [5, 6])  # a tuple or a list alike


def test_caching_disabled_never_registers():
    pool = BlockPool(2, enable_caching=False)
    (b,) = pool.get_new_blocks(1)
    assert not pool.cache_full_block(b, b"x") and pool.get_cached_block(b"x") is None
