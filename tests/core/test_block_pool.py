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


@pytest.mark.parametrize("seed", range(20))
def test_fresh_queue_makes_blocks_late_in_the_same_order(seed, monkeypatch):
    """A fresh queue (blocks made when first reached, 3 at a time here) hands out and orders blocks
    exactly as a queue of all blocks made up front, under any mix of operations."""
    import random

    from pagedserve.core import free_queue
    monkeypatch.setattr(free_queue, "MAKE_CHUNK", 3)
    n = 40
    ref_blocks = [KVCacheBlock(i) for i in range(n)]
    ref = FreeKVCacheBlockQueue(ref_blocks)
    lazy = FreeKVCacheBlockQueue.fresh(n)
    rng = random.Random(seed)
    out: list[int] = []  # ids handed out, not yet back
    for _ in range(300):
        op = rng.choice(["pop", "pop", "append", "appendleft", "remove", "peek"])
        if op == "pop" and len(ref):
            a, b = ref.popleft(), lazy.popleft()
            assert a.block_id == b.block_id
            out.append(a.block_id)
        elif op in ("append", "appendleft") and out:
            i = out.pop(rng.randrange(len(out)))
            getattr(ref, op)(ref_blocks[i])
            getattr(lazy, op)(lazy.block(i))
        elif op == "remove" and len(ref):
            # a free block revived from the middle (a prefix hit): one made already or not
            i = rng.choice([b.block_id for b in ref])
            ref.remove(ref_blocks[i])
            lazy.remove(lazy.block(i))
            out.append(i)
        elif op == "peek":
            lazy.block(rng.randrange(n))  # making a block must not move it
        assert len(lazy) == len(ref)
    assert lazy.block_ids() == ref.block_ids()


def test_a_large_pool_makes_only_the_blocks_it_reaches():
    pool = BlockPool(1 << 20, enable_caching=False)
    got = pool.get_new_blocks(5)
    assert [b.block_id for b in got] == [0, 1, 2, 3, 4]
    assert len(pool.blocks.made()) < 1000 and len(pool.blocks) == 1 << 20
    assert pool.get_num_free_blocks() == (1 << 20) - 5
    pool.free_blocks(reversed(got))
    assert pool.blocks[-1].block_id == (1 << 20) - 1 and pool.blocks[-1].ref_cnt == 0
    assert pool.get_num_free_blocks() == 1 << 20
