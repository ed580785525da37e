"""Exact states of the paged KV manager after each operation (vLLM v1 style)."""
import pytest

from pagedserve.core.kv_cache_manager import AllocStatus, KVCacheManager
from pagedserve.sequence import SequenceStatus

from core_helpers import check_pool, make_group


def mgr(num_blocks=8, cpu=0, caching=True):
    return KVCacheManager(block_size=4, num_gpu_blocks=num_blocks, num_cpu_blocks=cpu,
                          enable_prefix_caching=caching, watermark=0.0)


def refs(m, ids):
    return [m.pool.blocks[i].ref_cnt for i in ids]


def compute(m, seq, upto=None):
    """What update_after_step does once the runner computed the tokens."""
    seq.num_computed_tokens = seq.num_tokens if upto is None else upto
    m.cache_blocks(seq)


def test_allocate_append_free():
    m = mgr()
    g = make_group("a", list(range(10)))
    seq = g.seqs[0]
    assert m.can_allocate(g) is AllocStatus.OK
    m.allocate(g)
    assert m.get_block_table(seq) == [0, 1, 2] and refs(m, [0, 1, 2]) == [1, 1, 1]
    assert seq.num_computed_tokens == 0
    compute(m, seq)
    for expect in ([0, 1, 2], [0, 1, 2], [0, 1, 2, 3]):  # tokens 11, 12 fit block 2; 13 needs block 3
        seq.append_token(99)
        assert m.can_append_slots([(seq, 1)])
        assert m.append_slots(seq, 1) == []
        assert m.get_block_table(seq) == expect
        compute(m, seq)
    assert m.pool.free_block_queue.block_ids() == [4, 5, 6, 7]
    m.free(seq)
    # Reversed: the tail of the sequence sits nearer the LRU end than its prefix.
    assert m.pool.free_block_queue.block_ids() == [4, 5, 6, 7, 3, 2, 1, 0]
    check_pool(m.pool)


def test_fork_shares_then_copy_on_write():
    m = mgr()
    g = make_group("a", list(range(6)), n=2)
    parent = g.seqs[0]
    m.allocate(g)
    compute(m, parent)
    child = parent.fork()
    m.fork(parent, child)
    assert m.get_block_table(child) == [0, 1] and refs(m, [0, 1]) == [2, 2]
    parent.append_token(1)
    child.append_token(2)
    # Both write slot 6 in shared block 1: the first writer copies, the second then owns block 1 alone.
    assert m.can_append_slots([(parent, 1), (child, 1)])
    assert m.append_slots(parent, 1) == [(1, 2)]
    assert m.get_block_table(parent) == [0, 2] and refs(m, [0, 1, 2]) == [2, 1, 1]
    assert m.append_slots(child, 1) == []
    assert m.get_block_table(child) == [0, 1]
    m.free(parent)
    assert refs(m, [0, 1, 2]) == [1, 1, 0]
    m.free(child)
    assert m.pool.get_num_used_blocks() == 0
    check_pool(m.pool)


def test_fork_at_block_boundary_needs_no_copy():
    m = mgr()
    g = make_group("a", list(range(8)), n=2)
    parent = g.seqs[0]
    m.allocate(g)
    compute(m, parent)
    child = parent.fork()
    m.fork(parent, child)
    parent.append_token(1)
    child.append_token(2)
    assert m.append_slots(parent, 1) == [] and m.append_slots(child, 1) == []
    assert m.get_block_table(parent) == [0, 1, 2] and m.get_block_table(child) == [0, 1, 3]


def test_can_append_counts_copies():
    m = mgr(num_blocks=3)
    g = make_group("a", list(range(6)), n=3)
    p = g.seqs[0]
    m.allocate(g)
    compute(m, p)
    kids = [p.fork(), p.fork()]
    for k in kids:
        m.fork(p, k)
    for s in [p] + kids:
        s.append_token(0)
    assert m.get_num_free_blocks() == 1
    # Block 1 is shared three ways: two writers must copy, one block is free.
    assert not m.can_append_slots([(s, 1) for s in [p] + kids])
    assert m.can_append_slots([(p, 1)])


def test_prefix_hit_reuses_blocks_and_counts_tokens():
    m = mgr()
    a = make_group("a", list(range(9)))
    m.allocate(a)
    sa = a.seqs[0]
    compute(m, sa)  # blocks 0, 1 full and registered; block 2 holds one token
    assert m.pool.blocks[0].block_hash is not None and m.pool.blocks[2].block_hash is None
    b = make_group("b", list(range(8)) + [50, 51, 52])
    m.allocate(b)
    sb = b.seqs[0]
    assert m.get_block_table(sb) == [0, 1, 3] and refs(m, [0, 1]) == [2, 2]
    assert sb.num_computed_tokens == 8
    assert (m.prefix_cache_queries, m.prefix_cache_hits) == (9 + 11, 8)
    m.free(sa)
    assert m.pool.free_block_queue.block_ids() == [4, 5, 6, 7, 2]
    m.free(sb)
    assert m.pool.free_block_queue.block_ids() == [4, 5, 6, 7, 2, 3, 1, 0]
    assert m.pool.num_cached_free == 2
    # A cached-free prefix is revived from the middle of the queue.
    c = make_group("c", list(range(8)) + [60])
    m.allocate(c)
    assert m.get_block_table(c.seqs[0]) == [0, 1, 4]
    assert m.pool.free_block_queue.block_ids() == [5, 6, 7, 2, 3]
    check_pool(m.pool)


def test_full_prompt_hit_backs_off_one_block():
    m = mgr()
    a = make_group("a", list(range(8)))
    m.allocate(a)
    compute(m, a.seqs[0])
    b = make_group("b", list(range(8)))
    m.allocate(b)
    sb = b.seqs[0]
    # Both blocks are cached, but the last prompt token must be computed: the last hit is dropped.
    assert sb.num_computed_tokens == 4 and m.get_block_table(sb) == [0, 2]
    assert refs(m, [0, 1, 2]) == [2, 1, 1]


def test_generated_tokens_become_cacheable():
    m = mgr()
    a = make_group("a", [1, 2, 3])
    sa = a.seqs[0]
    m.allocate(a)
    compute(m, sa)
    sa.append_token(4)
    m.append_slots(sa, 1)
    compute(m, sa)
    assert m.pool.blocks[0].block_hash is not None
    b = make_group("b", [1, 2, 3, 4, 5])
    m.allocate(b)
    assert b.seqs[0].num_computed_tokens == 4


def test_a_prompt_taking_a_freed_table_holds_it_in_id_order():
    """A freed table goes back to the queue reversed (tail evicted first); the prompt that takes
    those blocks holds them in id order, so a prompt that got one run of the pool leaves one run
    (a long prefill reads such pages in place: attention/gathered_prefill.py)."""
    m = mgr(num_blocks=8)
    a = make_group("a", list(range(16)))
    m.allocate(a)
    assert m.get_block_table(a.seqs[0]) == [0, 1, 2, 3]
    compute(m, a.seqs[0])
    m.free(a.seqs[0])
    b = make_group("b", [7] * 16)
    m.allocate(b)  # the never-used blocks first
    assert m.get_block_table(b.seqs[0]) == [4, 5, 6, 7]
    assert m.pool.free_block_queue.block_ids() == [3, 2, 1, 0]
    c = make_group("c", [9] * 15)
    m.allocate(c)  # a's blocks, its cached content evicted
    assert m.get_block_table(c.seqs[0]) == [0, 1, 2, 3] and m.pool.num_cached_free == 0
    check_pool(m.pool)


def test_eviction_is_lru_and_tail_first():
    m = mgr(num_blocks=4)
    a = make_group("a", list(range(12)) + [100])
    m.allocate(a)
    compute(m, a.seqs[0])  # blocks 0, 1, 2 cached, 3 partial
    m.free(a.seqs[0])
    assert m.pool.free_block_queue.block_ids() == [3, 2, 1, 0]
    # A new unrelated prompt of two blocks takes block 3 then evicts block 2 (the prefix's tail),
    # and holds them in id order (one run of the pool, as a[2:4] was).
    b = make_group("b", [7] * 8)
    m.allocate(b)
    assert m.get_block_table(b.seqs[0]) == [2, 3]
    assert m.pool.blocks[2].block_hash is None and m.pool.num_cached_free == 2
    # The first two blocks of a's prefix still hit; reviving them takes free blocks too.
    c = make_group("c", list(range(8)) + [5])
    assert m.can_allocate(c) is AllocStatus.LATER
    m.free(b.seqs[0])
    assert m.pool.free_block_queue.block_ids() == [1, 0, 3, 2]
    m.allocate(c)
    assert c.seqs[0].num_computed_tokens == 8 and m.get_block_table(c.seqs[0]) == [0, 1, 3]
    check_pool(m.pool)


def test_never_when_larger_than_cache():
    m = mgr(num_blocks=2)
    assert m.can_allocate(make_group("a", list(range(9)))) is AllocStatus.NEVER
    assert m.can_allocate(make_group("b", list(range(8)))) is AllocStatus.OK


def test_swap_out_and_in_keeps_sharing():
    m = mgr(num_blocks=8, cpu=8)
    g = make_group("a", list(range(6)), n=2)
    p = g.seqs[0]
    m.allocate(g)
    compute(m, p)
    c = p.fork()
    m.fork(p, c)
    g.seqs.append(c)
    for s in g.seqs:
        s.status = SequenceStatus.RUNNING
    p.append_token(1)
    assert m.append_slots(p, 1) == [(1, 2)]
    compute(m, p)
    assert [m.get_block_table(s) for s in g.seqs] == [[0, 2], [0, 1]]
    assert m.can_swap_out(g)
    mapping = m.swap_out(g)
    assert mapping == [(0, 0), (2, 1), (1, 2)]  # shared block 0 moves once
    assert m.pool.get_num_used_blocks() == 0
    assert [[b.block_id for b in m.cpu_block_tables[s.seq_id]] for s in g.seqs] == [[0, 1], [0, 2]]
    assert [b.ref_cnt for b in m.cpu_pool.blocks[:3]] == [2, 1, 1]
    for s in g.seqs:
        s.status = SequenceStatus.SWAPPED
    assert m.can_swap_in(g)
    back = m.swap_in(g)
    assert sorted(c for c, _ in back) == [0, 1, 2]
    dev = dict(back)
    assert m.get_block_table(p) == [dev[0], dev[1]] and m.get_block_table(c) == [dev[0], dev[2]]
    assert m.pool.blocks[dev[0]].ref_cnt == 2 and m.cpu_pool.get_num_used_blocks() == 0
    check_pool(m.pool)
    check_pool(m.cpu_pool)


def test_swap_out_refused_without_cpu_room():
    m = mgr(num_blocks=8, cpu=1)
    g = make_group("a", list(range(6)))
    m.allocate(g)
    assert not m.can_swap_out(g)


def test_contiguous_refuses_fork():
    from pagedserve.core.contiguous import ContiguousKVCacheManager
    m = ContiguousKVCacheManager(4, 16, max_model_len=32)
    g = make_group("a", [1, 2, 3])
    m.allocate(g)
    with pytest.raises(ValueError, match="contiguous"):
        m.fork(g.seqs[0], g.seqs[0].fork())


def test_seq_layouts_snapshot_tables_and_sharing():
    m = mgr()
    g = make_group("a", list(range(6)), n=2)
    parent = g.seqs[0]
    m.allocate(g)
    compute(m, parent)
    child = parent.fork()
    m.fork(parent, child)
    parent.append_token(1)
    m.append_slots(parent, 1)  # copy-on-write of block 1 into block 2
    lay = {x.seq_id: x for x in m.seq_layouts()}
    assert lay[parent.seq_id].block_ids == m.get_block_table(parent) == [0, 2]
    assert lay[child.seq_id].block_ids == [0, 1]
    assert (lay[parent.seq_id].num_computed_tokens, lay[parent.seq_id].horizon) == (6, 7)
    # Table entries = sum of ref counts; distinct ids = blocks actually used.
    entries = sum(len(x.block_ids) for x in lay.values())
    assert entries == sum(b.ref_cnt for b in m.pool.blocks) == 4
    assert len({b for x in lay.values() for b in x.block_ids}) == m.pool.get_num_used_blocks() == 3


def test_contiguous_seq_layouts_are_reserved_runs():
    from pagedserve.core.contiguous import ContiguousKVCacheManager
    m = ContiguousKVCacheManager(4, 16, max_model_len=32, mode="oracle")
    a, b = make_group("a", [1, 2, 3], max_tokens=6, oracle=2), make_group("b", [4] * 9, max_tokens=2)
    m.allocate(a)
    m.allocate(b)
    lay = m.seq_layouts()
    assert [x.block_ids for x in lay] == [[0, 1], [2, 3, 4]]   # 3 + 2 -> 2 blocks; 9 + 2 -> 3 blocks
    assert [x.horizon for x in lay] == [5, 11] and [x.num_computed_tokens for x in lay] == [0, 0]


def test_block_hashes_chain_over_prompt_and_output_tokens():
    """Hashes of blocks that straddle the prompt/output boundary or lie in the outputs are the
    chained hashes of the full token list's blocks."""
    from pagedserve.core.block_pool import hash_block_tokens
    from pagedserve.sequence import Sequence
    for plen in (3, 4, 5, 8):
        seq = Sequence(list(range(10, 10 + plen)), output_token_ids=list(range(50, 61)))
        mgr = KVCacheManager(4, 16, 0)
        got = mgr._hashes(seq, seq.num_tokens // 4)
        want, prev = [], None
        toks = seq.token_ids
        for i in range(seq.num_tokens // 4):
            prev = hash_block_tokens(prev, toks[4 * i:4 * i + 4])
            want.append(prev)
        assert got == want


def test_sliding_window_frees_the_blocks_before_it():
    """Window 6, blocks of 4: before a step whose first position is p, the blocks wholly before
    p - 5 go back (cached-free: a later prompt still hits them); the kernels' view keeps their ids."""
    m = KVCacheManager(block_size=4, num_gpu_blocks=8, enable_prefix_caching=True, watermark=0.0, sliding_window=6)
    g = make_group("a", list(range(10)))
    seq = g.seqs[0]
    m.allocate(g)
    compute(m, seq)                      # 10 computed: the next row (position 10) sees 5..10
    seq.append_token(99)
    m.append_slots(seq, 1)
    assert m.block_tables[seq.seq_id][0] is None and m.get_block_table(seq) == [1, 2]
    assert m.block_table_view(seq) == [0, 1, 2]          # what the kernels read: masked there
    assert m.block_states()[:3] == "cuu" and refs(m, [1, 2]) == [1, 1]
    for _ in range(3):                   # positions 11..13: 13 sees 8..13, so block 1 (4..7) goes
        compute(m, seq)
        seq.append_token(98)
        m.append_slots(seq, 1)
    assert m.get_block_table(seq) == [2, 3] and m.block_table_view(seq) == [0, 1, 2, 3]
    assert m.memory_breakdown().token_states == 13 - 8  # the live blocks' computed tokens
    check_pool(m.pool)
    # A new prompt with the same first 8 tokens revives the freed, cached blocks.
    h = make_group("b", list(range(8)) + [5, 5, 5])
    assert m.can_allocate(h) is AllocStatus.OK
    m.allocate(h)
    assert m.get_block_table(h.seqs[0])[:2] == [0, 1] and h.seqs[0].num_computed_tokens == 8
    m.free(seq)
    m.free(h.seqs[0])
    assert m.pool.get_num_used_blocks() == 0
    check_pool(m.pool)


def test_sliding_window_fork_and_swap_carry_the_freed_entries():
    m = KVCacheManager(block_size=2, num_gpu_blocks=8, num_cpu_blocks=8, enable_prefix_caching=False,
                       watermark=0.0, sliding_window=2)
    g = make_group("a", list(range(6)), n=2)
    p = g.seqs[0]
    m.allocate(g)
    compute(m, p)                        # position 6 sees 5..6: blocks 0 and 1 go
    p.append_token(1)
    m.append_slots(p, 1)
    assert m.get_block_table(p) == [2, 3]
    c = p.fork()
    m.fork(p, c)
    g.seqs.append(c)
    assert refs(m, [2, 3]) == [2, 2] and m.block_tables[c.seq_id][:2] == [None, None]
    for s in g.seqs:
        s.status = SequenceStatus.RUNNING
    mapping = m.swap_out(g)
    assert sorted(src for src, _ in mapping) == [2, 3]   # only the live blocks move
    assert m.cpu_block_tables[p.seq_id][:2] == [None, None]
    for s in g.seqs:
        s.status = SequenceStatus.SWAPPED
    m.swap_in(g)
    assert len(m.get_block_table(p)) == 2 and m.pool.get_num_used_blocks() == 2
    assert m.block_table_view(p)[:2] == [0, 0]           # swapped in: freed entries read block 0
    for s in g.seqs:
        m.free(s)
    assert m.pool.get_num_used_blocks() == 0 and m.cpu_pool.get_num_used_blocks() == 0
    check_pool(m.pool)
    check_pool(m.cpu_pool)
