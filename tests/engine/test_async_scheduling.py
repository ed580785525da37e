"""Overlapped steps (EngineConfig.async_scheduling): the same tokens as synchronous steps, a
scheduler that really plans step N+1 before N's tokens are on the host, and nothing left behind;
with tensor parallelism (TP=2 on gloo) too, where the other rank's placeholders come from the ids
rank 0 broadcasts inside each step (runner/sampled_ids.py)."""
import pytest

from pagedserve import SamplingParams
from pagedserve.runner.batch import host_batch
from pagedserve.runner.row_tracker import INCREMENTAL_ENV

from .helpers import assert_no_leak, make_llm, prompt_ids

ABORT_AT = 5          # step at which the "victim" requests are aborted
LATE_SYNC_AT = 8      # step at which a request the overlap cannot serve (prompt_logprobs) joins


def _engine(model_dir, async_scheduling, mode="recompute", **kw):
    # 4-token blocks, 40 of them, a 32-token budget: chunked prompts, decodes and preemptions mix.
    kw = {**dict(block_size=4, num_gpu_blocks_override=40, swap_space=0.05, preemption_mode=mode,
                 max_num_batched_tokens=32), **kw}
    return make_llm(model_dir, async_scheduling=async_scheduling, **kw)


def _workload(ids, stop_after):
    """(step to add it at, request id, prompt, params). Greedy requests (some ended mid-batch by a
    stop token or EOS), seeded top-k / top-p sampling, one with penalties, logprobs and
    min_tokens, a seeded n=2 / best_of=3 fork, twins of the aborted ones, and a late
    request with prompt_logprobs that forces synchronous steps while it runs."""
    reqs = []
    for i, p in enumerate(ids):
        if i % 3 == 0:
            params = SamplingParams(temperature=0.0, max_tokens=16, stop_token_ids=[stop_after[i]])
        elif i % 3 == 1:
            params = SamplingParams(temperature=0.8, top_k=20, top_p=0.9, seed=100 + i, max_tokens=14)
        else:
            params = SamplingParams(temperature=0.0, max_tokens=12 + i)  # EOS may end it
        reqs.append((i % 4, f"r{i}", p, params))
    # Penalties read the token in flight on the device; logprobs and min_tokens overlap too.
    reqs.append((2, "forks", ids[3], SamplingParams(temperature=0.9, seed=9, n=2, best_of=3, max_tokens=12)))
    reqs.append((0, "penalised", ids[-1], SamplingParams(temperature=0.0, max_tokens=18, repetition_penalty=2.0,
                                                         frequency_penalty=2.0, logprobs=2, min_tokens=10)))
    long = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    for i in (1, 4):
        reqs += [(0, f"victim{i}", ids[i], long), (0, f"twin{i}", ids[i], long)]
    reqs.append((LATE_SYNC_AT, "prompt_logprobs", ids[2], SamplingParams(temperature=0.0, max_tokens=6, prompt_logprobs=1)))
    return reqs


def _count_placeholder_steps(counter: list):
    """A schedule spy: counter[0] counts the steps planned around at least one placeholder."""
    def spy(engine, out):
        counter[0] += any(s.seq.num_inflight_tokens for s in out.scheduled)
        return out
    return spy


def _run(llm, reqs, spy=None):
    engine = llm.llm_engine
    if spy is not None:
        schedule = engine.scheduler.schedule
        engine.scheduler.schedule = lambda: spy(engine, schedule())
    finals, partial, step = {}, {}, 0
    pending = sorted(reqs, key=lambda r: r[0])
    while pending or engine.has_unfinished_requests():
        while pending and pending[0][0] <= step:
            _, rid, prompt, params = pending.pop(0)
            engine.add_request(rid, {"prompt_token_ids": prompt}, params)
        if step == ABORT_AT:
            engine.abort_request(["victim1", "victim4"])
        for out in engine.step():
            c = out.outputs[0]
            partial[out.request_id] = list(c.token_ids)
            if out.finished:
                finals[out.request_id] = (list(c.token_ids), c.finish_reason, c.text,
                                          [list(o.token_ids) for o in out.outputs])  # a fork's every output
        step += 1
        assert step < 500
    assert_no_leak(llm)
    assert engine._inflight is None
    return finals, partial


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir):
    return tiny_model_dir("llama")


@pytest.fixture(scope="module")
def stop_after(model_dir):
    """For each prompt, its 4th greedy token: a stop token that ends it mid-batch."""
    ids = prompt_ids(model_dir)
    outs = make_llm(model_dir).generate([{"prompt_token_ids": p} for p in ids],
                                        SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True),
                                        use_tqdm=False)
    return [o.outputs[0].token_ids[-1] for o in outs]


# (tensor_parallel_size, preemption mode, PAGEDSERVE_INCREMENTAL_INPUTS; None: the default, on).
# At TP=2 both input paths run: the incremental device state (the default) and the full
# rebuild ("0", the A/B switch).
EXACT_CASES = [(1, "recompute", None), (1, "swap", None), (2, "recompute", "1"), (2, "swap", "1"),
               (2, "recompute", "0")]


@pytest.mark.parametrize("tp,mode,incremental", EXACT_CASES,
                         ids=[f"tp{t}-{m}-incremental{i or 'default'}" for t, m, i in EXACT_CASES])
def test_token_exact_with_overlap_on_and_off(model_dir, stop_after, monkeypatch, tp, mode, incremental):
    """Greedy, stop tokens, EOS, seeded top-k/top-p, aborts mid-run, a late request that forces
    synchronous steps, chunked prefill, prefix hits and preemption: overlap on equals overlap off;
    at TP=2, overlap on equals TP=1 with overlap off.

    At TP=2 the reference is TP=1's synchronous run, not a second TP=2 engine with overlap off:
    TP=2's synchronous steps equal TP=1's already in test_tp_generate.py (TestUnderPreemption:
    swap preemption, chunked prefill, sync and overlapped steps), and a second TP=2 start-up cost
    about 5 s a case; the TP=2 engine here is the one under test, overlapped."""
    if incremental is not None:
        monkeypatch.setenv(INCREMENTAL_ENV, incremental)  # the spawned rank inherits it
    ids = prompt_ids(model_dir)
    reqs = _workload(ids, stop_after)
    runs = {}
    for on in (True, False):
        llm = _engine(model_dir, on, mode, tensor_parallel_size=tp if on else 1)
        try:
            placeholder_steps = [0]
            runs[on] = _run(llm, reqs, _count_placeholder_steps(placeholder_steps))
            # Overlap really ran (the late prompt_logprobs request makes some steps synchronous, not all).
            assert placeholder_steps[0] >= 5 if on else placeholder_steps[0] == 0
            stats = llm.get_kv_cache_stats()
            assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0
            runner = llm.llm_engine.runner.runner  # rank 0's own ModelRunner
            assert (runner.row_tracker is not None) == (incremental != "0")
            assert runner.tp_size == (tp if on else 1)
        finally:
            llm.shutdown()
    (on_final, on_partial), (off_final, off_partial) = runs[True], runs[False]
    survivors = {r[1] for r in reqs} - {"victim1", "victim4"}
    assert survivors <= on_final.keys() and survivors <= off_final.keys()
    for rid in sorted(survivors):
        assert on_final[rid] == off_final[rid], rid
    assert any(on_final[f"r{i}"][1] == "stop" and len(on_final[f"r{i}"][0]) < 16 for i in range(0, len(ids), 3))
    for victim, twin in (("victim1", "twin1"), ("victim4", "twin4")):
        assert victim not in on_final and victim not in off_final
        for partial in (on_partial, off_partial):
            got = partial.get(victim, [])
            assert got == on_final[twin][0][:len(got)] and len(got) < 20


def test_next_step_is_planned_before_the_tokens_arrive(model_dir, stop_after):
    """Exact state at every schedule(): each decode planned right after a step that sampled it
    runs a placeholder, with a slot allocated for it; no sequence is planned past max_tokens."""
    ids = prompt_ids(model_dir)[:6]
    seen = {"placeholder_steps": 0, "max_inflight": 0, "rows": {}}

    def spy(engine, out):
        inflight = engine._inflight
        in_prev = {id(s.seq) for s in inflight.sampled} if inflight is not None else set()
        for g in engine.scheduler.running:
            for seq in g.seqs:
                seen["max_inflight"] = max(seen["max_inflight"], seq.num_inflight_tokens)
                if not seq.status.finished:
                    # A placeholder exists exactly for the sequences the step in flight samples.
                    assert seq.num_inflight_tokens == (1 if id(seq) in in_prev else 0)
        batch = host_batch(out.scheduled, out.num_decodes) if out.scheduled else None
        placeholders = set() if batch is None or batch.placeholder_dst is None else set(batch.placeholder_dst.tolist())
        for i, s in enumerate(out.scheduled):
            seq = s.seq
            if s.do_sample:
                seen["rows"][s.seq.seq_id] = seen["rows"].get(s.seq.seq_id, 0) + 1
            if seq.num_inflight_tokens:
                assert s.is_decode and s.start == seq.num_known_tokens == seq.num_computed_tokens
                assert i in placeholders
                assert batch.placeholder_src[sorted(placeholders).index(i)] == seq.inflight_sample_row
                assert len(s.block_table) * 4 >= s.start + 1  # the placeholder's slot is allocated
            else:
                assert i not in placeholders
        if placeholders:
            seen["placeholder_steps"] += 1
        return out

    llm = _engine(model_dir, True, num_gpu_blocks_override=400)
    engine = llm.llm_engine
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    stopped = SamplingParams(temperature=0.0, max_tokens=10, stop_token_ids=[stop_after[0]])
    reqs = [(0, f"r{i}", p, params) for i, p in enumerate(ids[1:])] + [(0, "stop", ids[0], stopped)]
    finals, _ = _run(llm, reqs, spy)
    assert seen["placeholder_steps"] >= 5 and seen["max_inflight"] == 1
    rows = sorted(seen["rows"].values())
    # Length-capped requests sample exactly max_tokens rows: none is planned past its limit. The
    # stopped one samples one row more than it keeps (the step after its stop token was in flight).
    assert rows.count(10) == len(ids) - 1
    n_stop = len(finals["stop"][0])
    assert finals["stop"][1] == "stop" and n_stop < 10
    assert n_stop + 1 in rows
    assert engine.scheduler.kv_cache_manager.get_num_free_blocks() == 400


def test_overlap_off_never_holds_placeholders(model_dir):
    llm = _engine(model_dir, False)
    held = []

    def spy(engine, out):
        held.extend(s.seq.num_inflight_tokens for s in out.scheduled)
        return out
    params = SamplingParams(temperature=0.0, max_tokens=6)
    reqs = [(0, f"r{i}", p, params) for i, p in enumerate(prompt_ids(model_dir)[:3])]
    _run(llm, reqs, spy)
    assert held and not any(held)


@pytest.mark.parametrize("params", [SamplingParams(temperature=0.0, max_tokens=4, prompt_logprobs=1)])
def test_requests_the_overlap_cannot_serve_make_steps_synchronous(model_dir, params):
    """While such a request is unfinished no step is planned around placeholders; before it
    joins and after it ends, steps overlap again."""
    ids = prompt_ids(model_dir)
    seen = []  # (sync-only request unfinished, any placeholder at schedule time)

    def spy(engine, out):
        seen.append((engine.has_request("special"),
                     any(s.seq.num_inflight_tokens for s in out.scheduled)))
        return out
    long = SamplingParams(temperature=0.0, max_tokens=14, ignore_eos=True)
    reqs = [(0, "a", ids[0], long), (0, "b", ids[1], long), (4, "special", ids[2], params)]
    llm = _engine(model_dir, True, num_gpu_blocks_override=400)
    finals, _ = _run(llm, reqs, spy)
    assert "special" in finals
    assert not any(placeholder for special, placeholder in seen if special)
    assert any(placeholder for special, placeholder in seen[:4])
    last_special = max(i for i, (special, _) in enumerate(seen) if special)
    assert any(placeholder for _, placeholder in seen[last_special + 1:])
    assert not llm.llm_engine._sync_requests


PENALTIES = {"repetition": SamplingParams(temperature=0.0, max_tokens=12, repetition_penalty=1.5, ignore_eos=True),
             "frequency": SamplingParams(temperature=0.0, max_tokens=12, frequency_penalty=1.0, presence_penalty=0.5,
                                         ignore_eos=True),
             "sampled_penalty": SamplingParams(temperature=0.8, seed=11, max_tokens=12, frequency_penalty=0.8,
                                               ignore_eos=True)}
FORKS = ("n2_seeded", "best_of3")


def test_logprobs_min_tokens_penalties_and_forks_overlap_and_equal_synchronous_steps(model_dir, stop_after):
    """Top-N logprobs (greedy and seeded sampling), min_tokens, repetition / frequency / presence
    penalties and forks (n, best_of > 1: synchronous until their first sample) no longer make
    steps synchronous: once the forks have sampled, steps are planned around placeholders, and the tokens, the chosen tokens' logprobs and the top-N sets equal a
    run with overlap off. min_tokens held back a stop token that plain greedy draws as its 4th
    token; the penalties changed what plain greedy writes (so the token in flight, which only the
    device has when the next step samples, was counted)."""
    ids = prompt_ids(model_dir)
    reqs = [(0, "greedy_top3", ids[0], SamplingParams(temperature=0.0, max_tokens=8, logprobs=3)),
            (0, "sampled_top2", ids[1], SamplingParams(temperature=0.8, seed=7, max_tokens=8, logprobs=2)),
            (1, "chosen_only", ids[2], SamplingParams(temperature=0.0, max_tokens=6, logprobs=0)),
            (1, "min_tokens", ids[3], SamplingParams(temperature=0.0, max_tokens=8, min_tokens=6,
                                                      stop_token_ids=[stop_after[3]])),
            (2, "plain", ids[0], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))]
    reqs += [(2, name, ids[0], params) for name, params in PENALTIES.items()]
    # Forks: synchronous until their first sample.
    reqs += [(3, "n2_seeded", ids[4], SamplingParams(temperature=0.9, seed=5, n=2, max_tokens=10, ignore_eos=True)),
             (3, "best_of3", ids[5], SamplingParams(temperature=0.9, seed=6, n=2, best_of=3, max_tokens=10,
                                                    ignore_eos=True, logprobs=1))]
    runs = {}
    for on in (True, False):
        llm = _engine(model_dir, on, num_gpu_blocks_override=400)
        engine = llm.llm_engine
        seen = []

        both_forked = []  # latched once both fork requests have forked

        def spy(engine, out):
            if not both_forked and all(rid in engine._groups and len(engine._groups[rid].seqs) > 1 for rid in FORKS):
                both_forked.append(True)
            seen.append((bool(engine._sync_requests), any(s.seq.num_inflight_tokens for s in out.scheduled),
                         bool(both_forked)))
            return out
        schedule = engine.scheduler.schedule
        engine.scheduler.schedule = lambda: spy(engine, schedule())
        finals, every = {}, {}
        for step in range(200):
            for when, rid, prompt, params in reqs:
                if when == step:
                    engine.add_request(rid, {"prompt_token_ids": prompt}, params)
            for out in engine.step():
                if out.finished:
                    finals[out.request_id] = out.outputs[0]
                    every[out.request_id] = out.outputs
            if step > 1 and not engine.has_unfinished_requests():
                break
        assert_no_leak(llm)
        llm.shutdown()
        runs[on] = (finals, seen, every)
    (on, seen_on, on_all), (off, _, off_all) = runs[True], runs[False]
    # Synchronous only until the fork requests have sampled their first token (their prompts' steps);
    # afterwards every step is planned around placeholders but the first (nothing in flight yet)
    # and the last (an empty schedule while the final tokens are in flight: nothing is planned past
    # max_tokens).
    assert any(sync for sync, _, _ in seen_on)
    after = [(sync, placeholder) for sync, placeholder, forked in seen_on if forked]
    assert len(after) >= 8 and not any(sync for sync, _ in after)
    assert all(placeholder for _, placeholder in after[1:-1])
    assert on.keys() == off.keys() == {r[1] for r in reqs}
    for rid in ("n2_seeded", "best_of3"):
        assert [c.token_ids for c in on_all[rid]] == [c.token_ids for c in off_all[rid]], rid
        assert len(on_all[rid]) == 2 and on_all[rid][0].token_ids != on_all[rid][1].token_ids
    for rid in on:
        a, b = on[rid], off[rid]
        assert a.token_ids == b.token_ids, rid
        if rid in PENALTIES:
            assert a.token_ids != on["plain"].token_ids, rid
        if rid in ("min_tokens", "plain", "n2_seeded") or rid in PENALTIES:
            assert a.logprobs is None
        if rid == "min_tokens":
            assert stop_after[3] not in a.token_ids[:5] and len(a.token_ids) >= 6
        if a.logprobs is None:
            continue
        assert len(a.logprobs) == len(a.token_ids)
        want = {"greedy_top3": 3, "sampled_top2": 2, "chosen_only": 0, "best_of3": 1}[rid]
        for tok, da, db in zip(a.token_ids, a.logprobs, b.logprobs):
            assert da.keys() == db.keys() and tok in da and len(da) in (want, want + 1)
            assert [da[t].logprob for t in sorted(da)] == pytest.approx([db[t].logprob for t in sorted(db)], abs=1e-5)
            assert [da[t].rank for t in sorted(da)] == [db[t].rank for t in sorted(db)]
