"""Shared helpers for the core tests: build groups, drive the scheduler like the engine does,
shadow the KV memory like the runner would, and check the docs/design.md invariants."""
from __future__ import annotations

from pagedserve.core.config import CacheConfig, SchedulerConfig
from pagedserve.core.block_pool import CACHED, FREE, SHARED, USED
from pagedserve.core.kv_cache_manager import KVCacheManager, cdiv
from pagedserve.core.plan import SchedulerOutput
from pagedserve.core.scheduler import Scheduler
from pagedserve.sampling_params import SamplingParams
from pagedserve.sequence import Sequence, SequenceGroup, SequenceStatus


def make_group(rid: str, tokens: list[int], max_tokens: int = 4, n: int = 1,
               oracle: int | None = None) -> SequenceGroup:
    params = SamplingParams(n=n, best_of=n, temperature=1.0, max_tokens=max_tokens, ignore_eos=True)
    return SequenceGroup(rid, [Sequence(list(tokens))], params, oracle_output_len=oracle)


def make_scheduler(num_gpu_blocks: int, block_size: int = 4, num_cpu_blocks: int = 0, *,
                   max_num_seqs: int = 256, max_num_batched_tokens: int = 8192, max_model_len: int = 1024,
                   preemption_mode: str = "recompute", enable_chunked_prefill: bool = True,
                   enable_prefix_caching: bool = True, kv_allocator: str = "paged",
                   watermark: float = 0.0, long_prefill_token_threshold: int = 0,
                   attention_cost_context: int = 0, long_prefill_chunk_align: int = 0,
                   attention_cost_min_tokens: int = 0, long_prefill_drain: int = 0,
                   long_prefill_drain_min_tokens: int = 32,
                   sliding_window: int = 0, scheduling_policy: str = "fcfs") -> Scheduler:
    cache = CacheConfig(block_size=block_size, num_gpu_blocks=num_gpu_blocks, num_cpu_blocks=num_cpu_blocks,
                        enable_prefix_caching=enable_prefix_caching, kv_allocator=kv_allocator,
                        sliding_window=sliding_window)
    sched = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                            max_model_len=max_model_len, enable_chunked_prefill=enable_chunked_prefill,
                            preemption_mode=preemption_mode, scheduling_policy=scheduling_policy,
                            long_prefill_token_threshold=long_prefill_token_threshold,
                            attention_cost_context=attention_cost_context,
                            attention_cost_min_tokens=attention_cost_min_tokens,
                            long_prefill_chunk_align=long_prefill_chunk_align,
                            long_prefill_drain=long_prefill_drain,
                            long_prefill_drain_min_tokens=long_prefill_drain_min_tokens)
    s = Scheduler(sched, cache)
    if isinstance(s.kv_cache_manager, KVCacheManager):
        s.kv_cache_manager.watermark_blocks = int(watermark * num_gpu_blocks)
    return s


class ShadowKV:
    """What the runner's memory would hold: per physical block, the token id written in each slot.

    Applies a SchedulerOutput in the runner's order (swap out, swap in, copy, then writes) and
    checks that every scheduled sequence then sees exactly its own tokens through its table; with
    a sliding window w, the positions its rows see: from its first row's position - w + 1 on.
    """

    def __init__(self, block_size: int, window: int = 0) -> None:
        self.bs = block_size
        self.window = window
        self.gpu: dict[int, list] = {}
        self.cpu: dict[int, list] = {}

    def apply(self, out: SchedulerOutput) -> None:
        for d, c in out.blocks_to_swap_out:
            self.cpu[c] = list(self.gpu.get(d, [None] * self.bs))
        for c, d in out.blocks_to_swap_in:
            self.gpu[d] = list(self.cpu[c])
        for src, dst in out.blocks_to_copy:
            self.gpu[dst] = list(self.gpu.get(src, [None] * self.bs))
        for ss in out.scheduled:
            toks = ss.seq.token_ids
            for pos in range(ss.start, ss.context_len):
                blk = self.gpu.setdefault(ss.block_table[pos // self.bs], [None] * self.bs)
                blk[pos % self.bs] = toks[pos]
        for ss in out.scheduled:
            toks = ss.seq.token_ids
            first = max(0, ss.start - self.window + 1) if self.window else 0
            seen = [self.gpu[ss.block_table[p // self.bs]][p % self.bs] for p in range(first, ss.context_len)]
            assert seen == toks[first:ss.context_len], f"seq {ss.seq.seq_id} attends to the wrong KV"


def check_write_targets(sched: Scheduler, out: SchedulerOutput) -> None:
    """Every block written this step is exclusively owned (ref_cnt 1) and carries no content hash."""
    mgr = sched.kv_cache_manager
    if not isinstance(mgr, KVCacheManager):
        return
    bs = mgr.block_size
    for ss in out.scheduled:
        for i in range(ss.start // bs, cdiv(ss.context_len, bs)):
            block = mgr.pool.blocks[ss.block_table[i]]
            assert block.ref_cnt == 1, f"block {block.block_id} written with ref_cnt {block.ref_cnt}"
            assert block.block_hash is None, f"cached block {block.block_id} written"
    for src, dst in out.blocks_to_copy:
        assert src != dst and mgr.pool.blocks[dst].ref_cnt == 1


def check_pool(pool) -> None:
    free_ids = pool.free_block_queue.block_ids()
    assert len(free_ids) == len(set(free_ids)) == pool.free_block_queue.num_free_blocks
    n_cached = 0
    for b in pool.blocks:
        in_queue = b.in_free_queue
        assert in_queue == (b.ref_cnt == 0), f"block {b.block_id}: ref {b.ref_cnt}, in queue {in_queue}"
        assert b.ref_cnt >= 0
        if b.block_hash is not None:
            assert pool.cached_block_hash_to_block[b.block_hash] is b
            n_cached += in_queue
    assert set(free_ids) == {b.block_id for b in pool.blocks if b.ref_cnt == 0}
    assert n_cached == pool.num_cached_free
    for h, b in pool.cached_block_hash_to_block.items():
        assert b.block_hash == h
    # The state letters the pool keeps up to date for the dashboard, against each block's fields.
    want = bytes((SHARED if b.ref_cnt > 1 else USED) if b.ref_cnt else
                 (CACHED if b.block_hash is not None else FREE) for b in pool.blocks)
    assert bytes(pool.codes) == want


def check_invariants(sched: Scheduler) -> None:
    mgr = sched.kv_cache_manager
    groups = list(sched.waiting) + list(sched.running) + list(sched.swapped)
    assert len({g.request_id for g in groups}) == len(groups), "a group sits in two queues"
    if not isinstance(mgr, KVCacheManager):
        assert mgr.num_free_blocks == mgr.num_gpu_blocks - sum(n for _, n in mgr._runs.values())
        for g in sched.waiting:
            assert all(not mgr.has_table(s) for s in g.seqs)
        return
    # running and swapped in the scheduler's order (admission; or priority, then admission)
    for queue in (sched.running, sched.swapped):
        keys = [sched.order_key(g) for g in queue]
        assert keys == sorted(keys), "running or swapped out of order"
    if sched.scheduler_config.scheduling_policy == "priority":
        keys = [(g.priority, g.arrived_at) for g in sched.waiting]
        assert keys == sorted(keys), "waiting out of priority order"
    bs = mgr.block_size
    for pool, tables in ((mgr.pool, mgr.block_tables), (mgr.cpu_pool, mgr.cpu_block_tables)):
        check_pool(pool)
        refs = {}
        for t in tables.values():
            for b in t:
                if b is not None:  # freed past the sliding window
                    refs[b.block_id] = refs.get(b.block_id, 0) + 1
        for b in pool.blocks:
            assert b.ref_cnt == refs.get(b.block_id, 0), f"block {b.block_id} ref {b.ref_cnt} != entries"
    # The block-id mirror the scheduler hands the runner matches the block objects.
    # (entries freed past a sliding window keep whatever id they had: read only under the mask)
    assert {sid: [b.block_id for b in t if b is not None] for sid, t in mgr.block_tables.items()} == \
        {sid: [i for b, i in zip(mgr.block_tables[sid], ids) if b is not None] for sid, ids in mgr._block_ids.items()}
    for sid, t in mgr.block_tables.items():  # freed entries lead the table, and only where the window passed
        freed = mgr._window_freed.get(sid, 0)
        assert all(b is None for b in t[:freed]) and all(b is not None for b in t[freed:])
        assert not freed or mgr.sliding_window
    live_ids = set()
    for g in groups:
        for s in g.seqs:
            live_ids.add(s.seq_id)
            st = s.status
            if st is SequenceStatus.RUNNING:
                t = mgr.block_tables[s.seq_id]
                assert s.seq_id not in mgr.cpu_block_tables
            elif st is SequenceStatus.SWAPPED:
                t = mgr.cpu_block_tables[s.seq_id]
                assert s.seq_id not in mgr.block_tables
            else:
                assert s.seq_id not in mgr.block_tables and s.seq_id not in mgr.cpu_block_tables
                continue
            awaiting_slot = s.num_uncomputed_tokens == 1 and s.output_token_ids
            ok = {cdiv(s.num_tokens, bs)} | ({cdiv(s.num_tokens - 1, bs)} if awaiting_slot else set())
            assert len(t) in ok, f"seq {s.seq_id}: {len(t)} blocks for {s.num_tokens} tokens"
            assert s.num_computed_tokens <= s.num_tokens
    assert set(mgr.block_tables) <= live_ids and set(mgr.cpu_block_tables) <= live_ids, "a table leaked"
    if not groups:
        assert mgr.pool.get_num_used_blocks() == 0 and mgr.cpu_pool.get_num_used_blocks() == 0


class Driver:
    """Plays the engine: schedule, run (shadow), update, sample, fork n>1 groups, finish."""

    def __init__(self, sched: Scheduler, seed: int = 0) -> None:
        import random
        self.sched = sched
        self.shadow = ShadowKV(sched.block_size, getattr(sched.kv_cache_manager, "sliding_window", 0))
        self.rng = random.Random(seed)
        self.finished: list[SequenceGroup] = []
        self.ignored: list[SequenceGroup] = []
        self.counts = {"preempted": 0, "swap out": 0, "swap in": 0, "copy-on-write": 0, "prefix hit": 0}

    def step(self) -> SchedulerOutput:
        sched = self.sched
        out = sched.schedule()
        check_write_targets(sched, out)
        self.ignored.extend(out.ignored)
        hits = sched.kv_cache_manager.prefix_cache_hits
        for key, n in (("preempted", len(out.preempted)), ("swap out", len(out.blocks_to_swap_out)),
                       ("swap in", len(out.blocks_to_swap_in)), ("copy-on-write", len(out.blocks_to_copy)),
                       ("prefix hit", hits)):
            self.counts[key] += bool(n)
        self.shadow.apply(out)
        sample = [ss for ss in out.scheduled if ss.do_sample]
        sched.update_after_step(out)
        for ss in sample:
            seq, group = ss.seq, ss.group
            if seq.status.finished:
                continue
            best_of = group.sampling_params.best_of
            if not seq.output_token_ids and len(group.seqs) < best_of:
                for _ in range(best_of - len(group.seqs)):
                    child = seq.fork()
                    sched.fork_seq(seq, child)
                    group.seqs.append(child)
                    self._sample(sched, group, child)
            self._sample(sched, group, seq)
        self.finished.extend(sched.free_finished_seq_groups())
        return out

    def _sample(self, sched, group, seq) -> None:
        seq.append_token(self.rng.randrange(50))
        if len(seq.output_token_ids) >= group.sampling_params.max_tokens:
            seq.status = SequenceStatus.FINISHED_LENGTH
            sched.free_seq(seq)

    def run(self, max_steps: int = 3000) -> None:
        for _ in range(max_steps):
            if not self.sched.has_unfinished_seqs():
                return
            self.step()
            check_invariants(self.sched)
        raise AssertionError("did not finish")
