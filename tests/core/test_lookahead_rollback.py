"""Speculative lookahead and its rollback, as exact-state properties.

Two schedulers run the same requests in lockstep. S (speculating) gives each running decode a
random number of proposed tokens, then accepts a random prefix of what it was granted and
appends that prefix plus one new token, as the engine does after verification. R never proposes:
it learns the same accepted tokens as ordinary known tokens and computes them as a chunk. After
every step the block-manager state of S must equal R's: the tables, every block's ref count and
hash, the prefix-cache index and the free queue (for one sequence, by block id; for several, up to
the naming of blocks that hold nothing, since S takes lookahead blocks sequence by sequence).
"""
import random

import pytest

from pagedserve.core.kv_cache_manager import cdiv
from tests.core.core_helpers import make_group, make_scheduler


def state(sched, seqs, by_id: bool):
    mgr = sched.kv_cache_manager
    pool = mgr.pool
    name = (lambda b: b.block_id) if by_id else (lambda b: (b.ref_cnt, b.block_hash))
    tables = {i: (s.num_computed_tokens, [name(b) for b in mgr.block_tables[s.seq_id]])
              for i, s in enumerate(seqs) if s.seq_id in mgr.block_tables}
    queue = [b.block_id if by_id else b.block_hash for b in pool.free_block_queue]
    blocks = sorted((b.ref_cnt, b.block_hash or b"") for b in pool.blocks)
    out = dict(tables=tables, queue=queue, blocks=blocks, num_cached_free=pool.num_cached_free,
               cached=sorted(pool.cached_block_hash_to_block), free=pool.get_num_free_blocks())
    if by_id:
        out["ids"] = [(b.block_id, b.ref_cnt, b.block_hash) for b in pool.blocks]
        out["codes"] = bytes(pool.codes)
    return out


def drive(block_size: int, prompts: list[list[int]], seed: int, by_id: bool, max_k: int = 5):
    rng = random.Random(seed)
    S = make_scheduler(400, block_size=block_size)
    R = make_scheduler(400, block_size=block_size)
    gs = [make_group(f"r{i}", p, max_tokens=40) for i, p in enumerate(prompts)]
    gr = [make_group(f"r{i}", p, max_tokens=40) for i, p in enumerate(prompts)]
    for g in gs:
        S.add_seq_group(g)
    for g in gr:
        R.add_seq_group(g)
    seqs_s = [g.seqs[0] for g in gs]
    seqs_r = [g.seqs[0] for g in gr]
    lookaheads = 0
    for _ in range(80):
        if not S.has_unfinished_seqs():
            break
        for s in seqs_s:
            s.spec_token_ids = [rng.randrange(50) for _ in range(rng.randrange(max_k + 1))] if s.is_decode else []
        out_s = S.schedule()
        # What S's step verifies, per sequence: an accepted prefix of its granted drafts.
        accepted = {}
        for ss in out_s.scheduled:
            k = ss.num_lookahead
            lookaheads += k
            a = rng.randint(0, k)
            ss.num_rejected = k - a
            accepted[ss.seq.seq_id] = ss.seq.spec_token_ids[:a]
        # R never proposed them: they reach it as ordinary known tokens, computed in this step.
        for s_s, s_r in zip(seqs_s, seqs_r):
            for t in accepted.get(s_s.seq_id, []):
                s_r.append_token(t)
        out_r = R.schedule()
        assert [s.seq.prompt_token_ids for s in out_r.scheduled if s.do_sample] is not None
        S.update_after_step(out_s)
        R.update_after_step(out_r)
        sampled_r = {s.seq.seq_id for s in out_r.scheduled if s.do_sample}
        for s in seqs_s:
            s.spec_token_ids = []
        for ss in out_s.scheduled:
            if not ss.do_sample:
                continue
            s_s = ss.seq
            s_r = seqs_r[seqs_s.index(s_s)]
            assert s_r.seq_id in sampled_r  # R's row reaches the same end of the sequence
            t = rng.randrange(50)
            for d in accepted[s_s.seq_id]:
                s_s.append_token(d)
            s_s.append_token(t)
            S.kv_cache_manager.cache_blocks(s_s)  # the engine does this after appending verified tokens
            s_r.append_token(t)
        for sch, seqs in ((S, seqs_s), (R, seqs_r)):
            for s in seqs:
                if len(s.output_token_ids) >= 30 and not s.status.finished:
                    s.status = s.status.FINISHED_LENGTH
                    sch.free_seq(s)
            sch.free_finished_seq_groups()
        assert state(S, seqs_s, by_id) == state(R, seqs_r, by_id)
    assert not S.has_unfinished_seqs()
    return lookaheads


@pytest.mark.parametrize("block_size", [1, 2, 4, 16])
@pytest.mark.parametrize("seed", range(4))
def test_one_sequence_state_equals_never_proposed_by_block_id(block_size, seed):
    rng = random.Random(seed)
    prompt = [rng.randrange(50) for _ in range(rng.randint(1, 20))]
    assert drive(block_size, [prompt], seed, by_id=True) > 0


@pytest.mark.parametrize("block_size", [1, 2, 4, 16])
@pytest.mark.parametrize("seed", range(4))
def test_many_sequences_with_shared_prefixes_state_equals_never_proposed(block_size, seed):
    rng = random.Random(100 + seed)
    base = [rng.randrange(50) for _ in range(12)]
    prompts = [base[:rng.randint(1, 12)] + [rng.randrange(50) for _ in range(rng.randint(0, 9))] for _ in range(5)]
    assert drive(block_size, prompts, seed, by_id=False) > 0


def test_lookahead_is_trimmed_to_max_tokens_and_budget():
    S = make_scheduler(100, block_size=4, max_num_batched_tokens=3)
    g = make_group("a", [1, 2, 3], max_tokens=3)
    S.add_seq_group(g)
    out = S.schedule()
    S.update_after_step(out)
    seq = g.seqs[0]
    seq.append_token(9)
    seq.spec_token_ids = [1, 2, 3, 4, 5]
    out = S.schedule()
    (ss,) = out.scheduled
    # max_tokens 3 with 1 output: the row may add 2 more, so 1 draft (+ the verification's token).
    assert ss.num_lookahead == 1 and ss.num_new_tokens == 2 and not ss.is_decode and ss.do_sample
    assert len(S.kv_cache_manager.block_tables[seq.seq_id]) == cdiv(3 + 2, 4)
