"""The seeds' scenario at tiny scale: many users behind one long system prompt.

With prefix caching the system prompt's blocks are stored once and computed once; the
outputs are exactly those of a run without caching.
"""
import random

import pytest

from pagedserve import SamplingParams
from .helpers import assert_no_leak, make_llm

BLOCK = 8
PREFIX_LEN = 96           # 12 full blocks of system prompt
USERS = 20
MAX_NEW = 6


def _requests(vocab: int = 300):
    rng = random.Random(0)
    prefix = [rng.randrange(3, vocab) for _ in range(PREFIX_LEN)]
    return prefix, [prefix + [rng.randrange(3, vocab) for _ in range(rng.randint(3, 20))] for _ in range(USERS)]


def _run(llm, prompts):
    """The first user arrives alone; the rest arrive once its prompt is in the cache.
    Returns (tokens per user, prompt tokens the runner computed per user, peak blocks)."""
    eng = llm.llm_engine
    computed: dict[str, int] = {}
    original = eng.scheduler.schedule

    def counting():
        out = original()
        for s in out.scheduled:
            if not s.is_decode:
                rid = s.group.request_id
                computed[rid] = computed.get(rid, 0) + s.num_new_tokens
        return out
    eng.scheduler.schedule = counting
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    eng.add_request("0", {"prompt_token_ids": prompts[0]}, params)
    outs = {}
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.finished:
                outs[o.request_id] = o.outputs[0].token_ids
    for i, p in enumerate(prompts[1:], start=1):
        eng.add_request(str(i), {"prompt_token_ids": p}, params)
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.finished:
                outs[o.request_id] = o.outputs[0].token_ids
    eng.scheduler.schedule = original
    tokens = [outs[str(i)] for i in range(len(prompts))]
    return tokens, [computed[str(i)] for i in range(len(prompts))], llm.get_kv_cache_stats()


@pytest.fixture(scope="module")
def runs(tiny_model_dir):
    model_dir = tiny_model_dir("llama")
    prefix, prompts = _requests()
    result = {}
    for caching in (False, True):
        llm = make_llm(model_dir, block_size=BLOCK, enable_prefix_caching=caching, num_gpu_blocks_override=600)
        result[caching] = _run(llm, prompts)
        assert_no_leak(llm)
    return prompts, result


def test_outputs_identical_with_and_without_prefix_caching(runs):
    _, result = runs
    assert result[True][0] == result[False][0]


def test_shared_prefix_is_computed_once(runs):
    prompts, result = runs
    _, computed_on, stats = result[True]
    _, computed_off, _ = result[False]
    assert computed_off == [len(p) for p in prompts]
    assert computed_on[0] == len(prompts[0])
    # Later users compute only what follows the cached full blocks of the system prompt.
    for p, c in zip(prompts[1:], computed_on[1:]):
        assert c == len(p) - PREFIX_LEN
    assert stats.prefix_cache_hits >= (USERS - 1) * PREFIX_LEN


def test_shared_prefix_is_stored_once(runs):
    prompts, result = runs
    peak_on = result[True][2].peak_blocks_used
    peak_off = result[False][2].peak_blocks_used
    prefix_blocks = PREFIX_LEN // BLOCK
    own_blocks = sum(-(-(len(p) - PREFIX_LEN + MAX_NEW) // BLOCK) for p in prompts)
    assert peak_on <= prefix_blocks + own_blocks + USERS
    assert peak_off > peak_on


def test_cache_salt_shares_cached_blocks_only_within_a_salt(tiny_model_dir):
    """vLLM's cache_salt (a prompt dict's key): a prompt hits the blocks another cached only when
    both carry the same salt (or none); the tokens never depend on it."""
    from .helpers import prompt_ids
    llm = make_llm(tiny_model_dir("llama"), block_size=4)
    p = (prompt_ids(tiny_model_dir("llama"))[0] * 4)[:21]
    sp = SamplingParams(temperature=0, max_tokens=3)

    def hits(**salt):
        before = llm.get_kv_cache_stats().prefix_cache_hits
        out = llm.generate([{"prompt_token_ids": p, **salt}], sp, use_tqdm=False)[0]
        hit = llm.get_kv_cache_stats().prefix_cache_hits - before
        assert out.num_cached_tokens == hit  # RequestOutput.num_cached_tokens (vLLM's)
        return hit, out.outputs[0].token_ids

    first, tokens = hits(cache_salt="a")
    assert first == 0
    assert hits(cache_salt="b") == (0, tokens)     # another tenant: nothing shared
    assert hits() == (0, tokens)                   # unsalted: nothing shared either
    assert hits(cache_salt="a") == (20, tokens)    # the same salt: every full block but the last token's
    assert hits() == (20, tokens)
    with pytest.raises(ValueError, match="cache_salt must be a non-empty string"):
        llm.generate([{"prompt_token_ids": p, "cache_salt": ""}], sp, use_tqdm=False)
