"""The dashboard's KV snapshot (core/kv_state.py): exact block states, owners and tables."""
import json

from core_helpers import Driver, check_invariants, make_group, make_scheduler

from pagedserve.core.kv_state import BLOCK_STATES, CONTIGUOUS_STATES, block_owners, kv_cache_state, state_names


def names(state):
    """The snapshot's states (one letter per block) as one name per block."""
    return state_names(state["states"])


def _check_against_pool(sched, state):
    """Every state, owner list and counter matches the pool's own bookkeeping."""
    mgr = sched.kv_cache_manager
    shown = names(state)
    assert len(shown) == state["num_blocks"] == mgr.num_gpu_blocks
    owners = block_owners(state)
    for b in mgr.pool.blocks:  # the states the pool keeps up to date, against each block's own fields
        want = ("shared" if b.ref_cnt > 1 else "used") if b.ref_cnt else \
            ("cached" if b.block_hash is not None else "free")
        assert shown[b.block_id] == want
        assert len(owners.get(b.block_id, [])) == b.ref_cnt  # one owner per table entry
    cpu_owners = block_owners(state, "cpu")
    assert state["num_cpu_blocks"] == mgr.cpu_pool.num_blocks
    for b in mgr.cpu_pool.blocks:
        assert len(cpu_owners.get(b.block_id, [])) == b.ref_cnt
        want = ("shared" if b.ref_cnt > 1 else "used") if b.ref_cnt else None
        assert state["cpu_states"].get(str(b.block_id)) == want
    st = state["stats"]
    assert st["num_blocks_used"] == sum(s in ("used", "shared") for s in shown)
    assert st["num_blocks_cached"] == shown.count("cached")
    assert st["num_blocks_free"] == shown.count("free") + shown.count("cached")
    assert st["num_live_tokens"] == mgr.memory_breakdown().token_states
    json.dumps(state)  # plain data only


def test_fresh_cache_is_all_free():
    sched = make_scheduler(8, block_size=4)
    state = kv_cache_state(sched)
    assert names(state) == ["free"] * 8 and state["requests"] == []
    assert state["allocator"] == "paged" and state["block_size"] == 4


def test_used_then_cached_after_finish():
    sched = make_scheduler(8, block_size=4)
    sched.add_seq_group(make_group("a", list(range(10)), max_tokens=3))
    d = Driver(sched)
    d.step()  # prefill: 10 tokens -> 3 blocks
    state = kv_cache_state(sched)
    (req,) = state["requests"]
    assert req["request_id"] == "a" and req["status"] == "running" and req["prompt_len"] == 10
    (seq,) = req["seqs"]
    assert seq["where"] == "gpu" and len(seq["block_table"]) == 3
    assert sorted(i for i, s in enumerate(names(state)) if s == "used") == sorted(seq["block_table"])
    assert block_owners(state)[seq["block_table"][1]] == [["a", seq["seq_id"], 1]]
    _check_against_pool(sched, state)
    d.run()
    state = kv_cache_state(sched)
    # 12 computed tokens (10 prompt + 2 of the 3 outputs; the last is never fed back) fill 3
    # blocks, which stay findable as prefix cache.
    assert names(state).count("cached") == 3 and names(state).count("used") == 0
    assert state["requests"] == []
    _check_against_pool(sched, state)


def test_prefix_sharing_and_fork_show_as_shared():
    sched = make_scheduler(32, block_size=4)
    prompt = list(range(12))
    sched.add_seq_group(make_group("a", prompt, max_tokens=8))
    d = Driver(sched)
    d.step()
    d.step()
    sched.add_seq_group(make_group("b", prompt + [40, 41], max_tokens=8))
    sched.add_seq_group(make_group("c", [7] * 5, max_tokens=8, n=2))
    d.step()
    d.step()
    state = kv_cache_state(sched)
    owners = block_owners(state)
    shared = [i for i, s in enumerate(names(state)) if s == "shared"]
    assert shared
    rids = {tuple(sorted({o[0] for o in owners[b]})) for b in shared}
    assert ("a", "b") in rids          # a prompt prefix reused across requests
    assert ("c",) in rids              # a fork: two sequences of one request
    c = next(r for r in state["requests"] if r["request_id"] == "c")
    assert len(c["seqs"]) == 2
    _check_against_pool(sched, state)
    check_invariants(sched)


def test_swapped_blocks_in_the_cpu_panel():
    sched = make_scheduler(6, block_size=4, num_cpu_blocks=16, preemption_mode="swap")
    for i in range(3):
        sched.add_seq_group(make_group(str(i), [i + 1] * 7, max_tokens=12))
    d = Driver(sched)
    seen = False
    while sched.has_unfinished_seqs():
        d.step()
        state = kv_cache_state(sched)
        _check_against_pool(sched, state)
        if sched.swapped:
            seen = True
            swapped = [r for r in state["requests"] if r["status"] == "swapped"]
            assert swapped and all(s["where"] == "cpu" for r in swapped for s in r["seqs"])
            assert state["cpu_states"] and set(state["cpu_states"].values()) <= {"used", "shared"}
    assert seen and state["num_swap_outs"] >= 1 and state["num_swap_ins"] == state["num_swap_outs"]
    assert state["stats"]["num_preemptions"] >= state["num_swap_outs"]


def test_contiguous_reservations_show_reserved_blocks():
    sched = make_scheduler(64, block_size=4, kv_allocator="contiguous-max", max_model_len=32)
    sched.add_seq_group(make_group("a", list(range(6)), max_tokens=4))
    d = Driver(sched)
    d.step()
    state = kv_cache_state(sched)
    (seq,) = state["requests"][0]["seqs"]
    run = seq["block_table"]
    assert run == list(range(8))  # max_model_len 32 / block_size 4, first fit at 0
    # 7 known tokens (prompt + first sample) occupy 2 blocks; the rest is reserved, unused.
    assert [names(state)[b] for b in run] == ["used"] * 2 + ["reserved"] * 6
    assert set(names(state)) <= set(CONTIGUOUS_STATES) and state["cpu_states"] == {}
    d.run()
    assert names(kv_cache_state(sched)) == ["free"] * 64


def test_contiguous_would_need_counts_running_sequences():
    sched = make_scheduler(64, block_size=4, max_model_len=100)
    sched.add_seq_group(make_group("a", list(range(6)), max_tokens=10))
    sched.add_seq_group(make_group("b", list(range(20, 29)), max_tokens=5, n=2))
    d = Driver(sched)
    d.step()
    d.step()
    need = kv_cache_state(sched)["contiguous_would_need"]
    assert need == {"max_model_len": 3 * 100, "prompt_plus_max_tokens": (6 + 10) + 2 * (9 + 5)}
    assert set(names(kv_cache_state(sched))) <= set(BLOCK_STATES)


def test_snapshot_matches_the_pool_at_every_step_of_a_busy_run():
    """Prefix sharing, forks, swaps and preemption by recompute, all checked step by step."""
    import random
    rng = random.Random(7)
    sched = make_scheduler(40, block_size=4, num_cpu_blocks=24, preemption_mode="auto")
    base = [rng.randrange(50) for _ in range(9)]
    for i in range(14):
        tokens = base + [rng.randrange(50) for _ in range(rng.randrange(1, 12))] if i % 2 else \
            [rng.randrange(50) for _ in range(rng.randrange(3, 20))]
        sched.add_seq_group(make_group(str(i), tokens, max_tokens=rng.randrange(4, 24), n=1 + (i % 3 == 0)))
    d = Driver(sched, seed=1)
    kinds = set()
    while sched.has_unfinished_seqs():
        d.step()
        state = kv_cache_state(sched)
        _check_against_pool(sched, state)
        kinds.update(names(state))
        kinds.update(r["status"] for r in state["requests"])
    assert {"used", "shared", "cached", "swapped"} <= kinds


def test_contiguous_live_tokens_match_the_breakdown():
    sched = make_scheduler(64, block_size=4, kv_allocator="contiguous-pow2", max_model_len=64)
    for i in range(6):
        sched.add_seq_group(make_group(str(i), list(range(3 + i)), max_tokens=5 + i))
    d = Driver(sched)
    while sched.has_unfinished_seqs():
        d.step()
        state = kv_cache_state(sched)
        assert state["stats"]["num_live_tokens"] == sched.kv_cache_manager.memory_breakdown().token_states
        assert state["stats"]["num_blocks_used"] == sum(s != "free" for s in names(state))
