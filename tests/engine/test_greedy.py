"""Greedy decoding equals HF generate(do_sample=False), token for token, whatever the memory pressure."""
import pytest

from pagedserve import SamplingParams
from tiny_models import ARCHS

from .helpers import assert_no_leak, hf_greedy, make_llm, prompt_ids

MAX_TOKENS = 12


def _check(llm, model_dir, ids, max_tokens=MAX_TOKENS, ignore_eos=False):
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=ignore_eos)
    outs = llm.generate([{"prompt_token_ids": p} for p in ids], params, use_tqdm=False)
    for p, out in zip(ids, outs):
        assert out.prompt_token_ids == p
        assert out.outputs[0].token_ids == hf_greedy(model_dir, p, max_tokens, ignore_eos), p
    assert_no_leak(llm)
    return outs


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_batch_matches_hf(tiny_model_dir, arch):
    model_dir = tiny_model_dir(arch)
    llm = make_llm(model_dir)
    _check(llm, model_dir, prompt_ids(model_dir))


# Every test here runs with overlapped steps (the default); those that exercise the scheduler's
# preemption, chunking and caching paths also run synchronous (async_scheduling=False).
@pytest.mark.parametrize("async_scheduling", [True, False])
@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_greedy_under_preemption(tiny_model_dir, mode, async_scheduling):
    model_dir = tiny_model_dir("llama")
    ids = prompt_ids(model_dir)
    # 8 tokens per block; the longest request (90 + 20 tokens) needs 14 blocks: 16 force preemptions.
    llm = make_llm(model_dir, block_size=8, num_gpu_blocks_override=16, preemption_mode=mode,
                   swap_space=0.05, max_num_batched_tokens=64, async_scheduling=async_scheduling)
    sched = llm.llm_engine.scheduler
    swaps = []
    schedule = sched.schedule

    def spy():
        out = schedule()
        swaps.append(len(out.blocks_to_swap_out))
        return out
    sched.schedule = spy
    _check(llm, model_dir, ids, max_tokens=20, ignore_eos=True)
    assert llm.get_kv_cache_stats().num_preemptions > 0
    assert (sum(swaps) > 0) == (mode == "swap")


@pytest.mark.parametrize("block_size,async_scheduling", [(1, True), (8, True), (16, True), (32, True), (8, False)])
def test_greedy_block_sizes_and_chunked_prefill(tiny_model_dir, block_size, async_scheduling):
    model_dir = tiny_model_dir("qwen2")
    # A 7-token budget chunks every prompt longer than that, mixed with decodes.
    llm = make_llm(model_dir, block_size=block_size, max_num_batched_tokens=7, async_scheduling=async_scheduling)
    _check(llm, model_dir, prompt_ids(model_dir))


def test_greedy_with_long_prefill_token_threshold(tiny_model_dir):
    """vLLM's long_prefill_token_threshold reaches the scheduler: no prefill chunk above it, the
    budget (64) left to the other prompts and the decodes, and the tokens HF's."""
    model_dir = tiny_model_dir("llama")
    llm = make_llm(model_dir, block_size=4, max_num_batched_tokens=64, long_prefill_token_threshold=5)
    sched = llm.llm_engine.scheduler
    chunks = []
    schedule = sched.schedule

    def spy():
        out = schedule()
        chunks.extend(x.num_new_tokens for x in out.scheduled if not x.is_decode)
        return out
    sched.schedule = spy
    _check(llm, model_dir, prompt_ids(model_dir))
    assert max(chunks) == 5 and len(chunks) > len(prompt_ids(model_dir))


def test_greedy_with_long_prefill_chunk_align(tiny_model_dir):
    """long_prefill_chunk_align reaches the scheduler: a prompt's chunks that the budget cut short
    end on multiples of 4, and the tokens are HF's."""
    model_dir = tiny_model_dir("llama")
    llm = make_llm(model_dir, block_size=4, max_num_batched_tokens=7, long_prefill_chunk_align=4)
    sched, chunks = llm.llm_engine.scheduler, []
    assert sched.scheduler_config.long_prefill_chunk_align == 4
    schedule = sched.schedule

    def spy():
        out = schedule()
        chunks.extend((x.start, x.num_new_tokens, x.do_sample) for x in out.scheduled if not x.is_decode)
        return out
    sched.schedule = spy
    _check(llm, model_dir, prompt_ids(model_dir))
    cut = [(start, n) for start, n, last in chunks if not last]  # not a prompt's last chunk
    assert cut and all((start + n) % 4 == 0 or (start + n) // 4 * 4 <= start for start, n in cut)


def test_greedy_with_long_prefill_budget_by_cost(tiny_model_dir):
    """long_prefill_budget_by_cost: the scheduler gets K from the model's shape (model_cost), each
    step with a decode keeps its decodes plus its chunks' costs (their attention over their context
    counted) within the token budget, every step its tokens, and the tokens are HF's."""
    from pagedserve.core.chunk_cost import chunk_cost
    from pagedserve.model_cost import ModelCost
    model_dir = tiny_model_dir("llama")
    from pagedserve.core.chunk_cost import COST_MIN_TOKENS, COST_SCALE
    llm = make_llm(model_dir, block_size=4, max_num_batched_tokens=16, long_prefill_budget_by_cost=True)
    engine = llm.llm_engine
    k = engine.scheduler_config.attention_cost_context
    model_k = ModelCost.from_hf_config(engine.hf_config).attention_cost_context()
    assert k == round(model_k * COST_SCALE) > 0
    one = make_llm(model_dir, block_size=4, max_num_batched_tokens=16, long_prefill_budget_by_cost=True,
                   long_prefill_cost_scale=1.0)
    assert one.llm_engine.scheduler_config.attention_cost_context == model_k
    assert engine.scheduler_config.attention_cost_min_tokens == COST_MIN_TOKENS
    engine.scheduler_config.attention_cost_min_tokens = 0  # the tiny model's prompts are short: count theirs
    sched, steps = engine.scheduler, []
    schedule = sched.schedule

    def spy():
        out = schedule()
        steps.append([(x.is_decode, x.start, x.num_new_tokens) for x in out.scheduled])
        return out
    sched.schedule = spy
    _check(llm, model_dir, prompt_ids(model_dir))
    beside = [st for st in steps if any(dec for dec, _, _ in st)]  # costs count only beside a decode
    assert max(sum(n if dec else chunk_cost(start, n, k) for dec, start, n in st) for st in beside) <= 16
    assert any(chunk_cost(start, n, k) > n for st in beside for dec, start, n in st if not dec)
    assert max(sum(n for _, _, n in st) for st in steps) <= 16


def test_long_prompt_chunk_rules_follow_the_long_prefill_path(tiny_model_dir, monkeypatch):
    """Unset, chunk alignment is on where the runner turned the Hopper long-prefill path on (whole
    query steps, CHUNK_ALIGN), off where it did not (here on CPU); chunks by cost are off unless asked
    (then for prompts of COST_MIN_TOKENS+, K the model's balance times COST_SCALE); set, each is
    what was asked."""
    from pagedserve.attention import gathered_prefill
    from pagedserve.core.chunk_cost import CHUNK_ALIGN, COST_MIN_TOKENS, COST_SCALE
    from pagedserve.model_cost import ModelCost
    model_dir = tiny_model_dir("llama")

    def rules(**kw):
        c = make_llm(model_dir, block_size=4, **kw).llm_engine.scheduler_config
        return c.long_prefill_chunk_align, c.attention_cost_context, c.attention_cost_min_tokens
    k = ModelCost.from_hf_config(make_llm(model_dir, block_size=4).llm_engine.hf_config).attention_cost_context()
    assert rules() == (0, 0, 0)
    assert rules(long_prefill_chunk_align=16)[0] == 16
    assert rules(long_prefill_budget_by_cost=True) == (0, round(k * COST_SCALE), COST_MIN_TOKENS)
    monkeypatch.setattr(gathered_prefill, "configure", lambda *a, **kw: object())  # as on an H200
    assert rules() == (CHUNK_ALIGN, 0, 0)
    assert rules(long_prefill_budget_by_cost=True, long_prefill_chunk_align=8192) == (
        8192, round(k * COST_SCALE), COST_MIN_TOKENS)  # the schedule before the 57th session
    assert rules(long_prefill_chunk_align=0) == (0, 0, 0)


def test_long_prefill_drain_reaches_the_scheduler(tiny_model_dir, monkeypatch):
    """long_prefill_drain=N: a long prompt arriving while a request is 3 tokens from its max_tokens
    starts only once that request has finished (its prompt of 32 tokens may wait 32 // 4 steps; the
    engine's minimum prompt, COST_MIN_TOKENS, lowered to 16 here); off, it starts beside it. The
    tokens are the same either way (greedy). Unset, it is on at 2048 (measured on the H200: a 100k
    prompt 1.3% later, the request 27 tokens from its end done in 0.26 s instead of 6.1)."""
    from pagedserve import config as engine_config
    assert engine_config.EngineConfig().long_prefill_drain == 2048
    monkeypatch.setattr(engine_config, "COST_MIN_TOKENS", 16)
    model_dir = tiny_model_dir("llama")
    ids = prompt_ids(model_dir)
    short, long_ = ids[0][:5], (ids[1] * 8)[:32]
    runs = {}
    for drain in (0, 4):
        llm = make_llm(model_dir, block_size=4, long_prefill_drain=drain)
        eng = llm.llm_engine
        assert eng.scheduler_config.long_prefill_drain == drain
        steps, schedule = [], eng.scheduler.schedule

        def spy():
            out = schedule()
            steps.append({x.group.request_id for x in out.scheduled})
            return out
        eng.scheduler.schedule = spy
        eng.add_request("a", short, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
        tokens = {}
        while not any("a" in st for st in steps[:-1]) or len(steps) < 2:
            eng.step()  # a's prefill ran and its first token came back: 3 to go
        eng.add_request("l", long_, SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
        while eng.has_unfinished_requests():
            for o in eng.step():
                if o.finished:
                    tokens[o.request_id] = list(o.outputs[0].token_ids)
        first_l = next(i for i, st in enumerate(steps) if "l" in st)
        last_a = max(i for i, st in enumerate(steps) if "a" in st)
        runs[drain] = (first_l > last_a, tokens)
    assert runs[4][0] and not runs[0][0]
    assert runs[4][1] == runs[0][1] and len(runs[0][1]["a"]) == 4


@pytest.mark.parametrize("prefix_caching,async_scheduling", [(True, True), (False, True), (True, False)])
def test_greedy_prefix_caching_on_off(tiny_model_dir, prefix_caching, async_scheduling):
    model_dir = tiny_model_dir("mistral")
    ids = prompt_ids(model_dir)
    llm = make_llm(model_dir, block_size=4, enable_prefix_caching=prefix_caching, async_scheduling=async_scheduling)
    _check(llm, model_dir, ids)
    _check(llm, model_dir, ids)  # second round: every full prompt block is cached
    stats = llm.get_kv_cache_stats()
    assert (stats.prefix_cache_hits > 0) == prefix_caching


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_requests_arriving_while_others_decode(tiny_model_dir, async_scheduling):
    model_dir = tiny_model_dir("opt")
    ids = prompt_ids(model_dir)
    llm = make_llm(model_dir, block_size=8, max_num_batched_tokens=16, async_scheduling=async_scheduling)
    engine = llm.llm_engine
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    done, pending, step = {}, list(enumerate(ids)), 0
    while pending or engine.has_unfinished_requests():
        if pending and step % 3 == 0:
            i, p = pending.pop(0)
            engine.add_request(f"r{i}", {"prompt_token_ids": p}, params)
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
        step += 1
    for i, p in enumerate(ids):
        assert done[f"r{i}"] == hf_greedy(model_dir, p, MAX_TOKENS)
    assert_no_leak(llm)


# The mixtures of experts in the same memory regimes, one family per regime (each family's roomy
# batch is in test_greedy_batch_matches_hf): the expert routing of a token must not depend on
# which other tokens share its step, its chunk, or whether its prefix came from the cache.
@pytest.mark.parametrize("arch,mode", [("qwen3_moe", "recompute"), ("mixtral", "swap")])
def test_moe_greedy_under_preemption(tiny_model_dir, arch, mode):
    model_dir = tiny_model_dir(arch)
    llm = make_llm(model_dir, block_size=8, num_gpu_blocks_override=16, preemption_mode=mode,
                   swap_space=0.05, max_num_batched_tokens=64)
    _check(llm, model_dir, prompt_ids(model_dir)[:6], max_tokens=16, ignore_eos=True)
    assert llm.get_kv_cache_stats().num_preemptions > 0


def test_moe_greedy_chunked_prefill(tiny_model_dir):
    model_dir = tiny_model_dir("qwen2_moe")
    llm = make_llm(model_dir, block_size=8, max_num_batched_tokens=7)
    _check(llm, model_dir, prompt_ids(model_dir))


def test_moe_greedy_prefix_caching(tiny_model_dir):
    model_dir = tiny_model_dir("qwen3_moe")
    ids = prompt_ids(model_dir)
    llm = make_llm(model_dir, block_size=4)
    _check(llm, model_dir, ids)
    _check(llm, model_dir, ids)
    assert llm.get_kv_cache_stats().prefix_cache_hits > 0
