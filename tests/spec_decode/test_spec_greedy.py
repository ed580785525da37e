"""Greedy output with n-gram speculation equals output without it, token for token, across the
dense tests' memory regimes (recompute, swap, chunked prefill, prefix caching) and block sizes
1, 16 and 32, with speculation in every step and with the shipped yield pausing (steps switch
between paused, overlapped ones and speculating probes, through preemptions); and the reference
itself equals HF's greedy generate."""
import pytest

from pagedserve import SamplingParams
from engine.helpers import assert_no_leak, hf_greedy, make_llm, tokenizer

from spec_decode.spec_helpers import NGRAM, NGRAM_EAGER_PAUSE, TEXTS, verified_probes


def _ids(model_dir):
    tok = tokenizer(str(model_dir))
    return [tok.encode(t) for t in TEXTS]


def _run(llm, ids, max_tokens):
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in ids], params, use_tqdm=False)
    assert_no_leak(llm)
    return [o.outputs[0].token_ids for o in outs]


def _check(model_dir, max_tokens=24, spec=NGRAM, verified=False, both_outcomes=True, **kw):
    ids = _ids(model_dir)
    llm = make_llm(model_dir, speculative_config=spec, **kw)
    if verified:
        verified_probes(llm)
    got = _run(llm, ids, max_tokens)
    for p, g in zip(ids, got):
        assert g == hf_greedy(model_dir, p, max_tokens, ignore_eos=True), p
    stats = llm.llm_engine.speculator.stats
    # Speculation really ran, and both outcomes happened: accepted and rejected proposals.
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens or not both_outcomes, stats
    return llm


@pytest.mark.parametrize("block_size", [1, 16, 32])
def test_block_sizes(tiny_model_dir, block_size):
    _check(tiny_model_dir("llama"), block_size=block_size)


@pytest.mark.parametrize("pausing", [False, True])
@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption(tiny_model_dir, mode, pausing):
    # 8-token blocks, 18 of them for 5 sequences (the longest 88 + 30 tokens): preemptions. Pausing,
    # the probes are verified steps (as a draft model's): an n-gram's would be shadow probes, and at
    # this threshold only a wholly accepted one would ever let a step verify.
    llm = _check(tiny_model_dir("llama"), max_tokens=30, block_size=8, num_gpu_blocks_override=18,
                 preemption_mode=mode, swap_space=0.05, max_num_batched_tokens=64,
                 spec=NGRAM_EAGER_PAUSE if pausing else NGRAM, verified=pausing)
    assert llm.get_kv_cache_stats().num_preemptions > 0
    assert (llm.get_spec_decode_stats().num_paused_steps > 0) == pausing


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_with_shadow_probes(tiny_model_dir, mode):
    """The shipped threshold with the n-gram's own shadow probes (spec_decode/shadow.py): steps
    switch between shadow probes scored over several steps, verified speculation and pauses,
    through preemptions that take a probe's sequences away; greedy output stays HF's."""
    llm = _check(tiny_model_dir("llama"), max_tokens=30, block_size=8, num_gpu_blocks_override=18,
                 preemption_mode=mode, swap_space=0.05, max_num_batched_tokens=64,
                 spec={k: v for k, v in NGRAM.items() if k != "min_speculation_yield"}, both_outcomes=False)
    stats = llm.get_spec_decode_stats()
    assert llm.get_kv_cache_stats().num_preemptions > 0
    assert stats.num_shadow_probes > 0 and stats.num_spec_steps > 0


def test_chunked_prefill_small_budget(tiny_model_dir):
    # A 7-token budget: prompts chunk beside speculating decodes, and lookahead is trimmed to it.
    _check(tiny_model_dir("qwen2"), block_size=4, max_num_batched_tokens=7)


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_prefix_caching(tiny_model_dir, prefix_caching):
    model_dir = tiny_model_dir("mistral")
    llm = _check(model_dir, block_size=4, enable_prefix_caching=prefix_caching)
    # Second round: cached blocks (hashed over verified tokens only) serve the same outputs.
    ids = _ids(model_dir)
    assert _run(llm, ids, 24) == [hf_greedy(model_dir, p, 24, ignore_eos=True) for p in ids]
    assert (llm.get_kv_cache_stats().prefix_cache_hits > 0) == prefix_caching
