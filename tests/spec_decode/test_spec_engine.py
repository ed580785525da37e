"""Speculation keeps the engine's semantics: stop tokens, stop strings and max_tokens inside an
accepted run end a sequence exactly where decoding without speculation ends it; the adaptive
policy switches between speculating (synchronous) and overlapped steps mid-request; seeded
sampling is reproducible; requests that cannot speculate run beside those that do; combinations
that cannot speculate at all are refused by name."""
import pytest

from pagedserve import SamplingParams
from engine.helpers import assert_no_leak, make_llm, tokenizer
from spec_decode.spec_helpers import NGRAM, TEXTS


@pytest.fixture(scope="module")
def pair(tiny_model_dir):
    model_dir = tiny_model_dir("llama")
    tok = tokenizer(str(model_dir))
    ids = [tok.encode(t) for t in TEXTS]
    return model_dir, ids, make_llm(model_dir, block_size=4), make_llm(model_dir, block_size=4, speculative_config=NGRAM)


def _gen(llm, ids, params):
    outs = llm.generate([{"prompt_token_ids": p} for p in ids], params, use_tqdm=False)
    assert_no_leak(llm)
    return [(o.outputs[0].token_ids, o.outputs[0].text, o.outputs[0].finish_reason) for o in outs]


def test_stop_token_string_and_max_tokens_inside_accepted_runs(pair):
    model_dir, ids, base, spec = pair
    ids = ids[:3]  # copy-heavy and plain: enough for runs accepted across a stop
    free = _gen(base, ids, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True))
    # A stop token and a stop string taken from the middle of each output.
    for i, (toks, text, _) in enumerate(free):
        stop_tok = toks[len(toks) // 2]
        stop_str = text[len(text) // 2:len(text) // 2 + 2]
        for params in (SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, stop_token_ids=[stop_tok]),
                       SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, stop=[stop_str])
                       if stop_str.strip() else None,
                       SamplingParams(temperature=0.0, max_tokens=7 + i, ignore_eos=True)):
            if params is None:
                continue
            assert _gen(spec, [ids[i]], params) == _gen(base, [ids[i]], params), (i, params)
    assert spec.llm_engine.speculator.stats.num_accepted_tokens > 0


def test_requests_that_end_in_their_first_step_are_reported(pair):
    """A max_tokens=1 request ends in its prefill step; the next (synchronous, speculating) step
    drops it from the running queue before the step's end collects finished groups: it must still
    come back (it once hung LLM.generate)."""
    model_dir, ids, base, spec = pair
    for max_tokens in ([1], [1, 6], [6, 1, 2]):
        params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in max_tokens]
        got = _gen(spec, ids[:len(max_tokens)], params)
        assert got == _gen(base, ids[:len(max_tokens)], params)
        assert [len(t) for t, _, _ in got] == max_tokens


def test_policy_switches_between_speculating_and_overlapped_steps(tiny_model_dir, pair):
    model_dir, ids, base, _ = pair
    # Threshold 6 tokens: with 5 running no speculation (overlapped steps), with 1-2 left k = 1-2.
    cfg = dict(NGRAM, spec_disable_batch_tokens=6)
    llm = make_llm(model_dir, block_size=4, speculative_config=cfg)
    params = [SamplingParams(temperature=0.0, max_tokens=8 + 6 * i, ignore_eos=True) for i in range(len(ids))]
    want = [o.outputs[0].token_ids for o in base.generate([{"prompt_token_ids": p} for p in ids], params,
                                                         use_tqdm=False)]
    got = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in ids], params,
                                                       use_tqdm=False)]
    assert got == want
    stats = llm.llm_engine.speculator.stats
    assert stats.num_draft_tokens > 0


def test_seeded_sampling_is_reproducible_and_mixes_with_plain_requests(pair):
    _, ids, _, spec = pair
    seeded = SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=20, ignore_eos=True)
    a = _gen(spec, ids, seeded)
    b = _gen(spec, ids, seeded)
    assert a == b
    # A request that cannot speculate (penalty, logprobs) beside speculating ones.
    mixed = [seeded, SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, repetition_penalty=1.2),
             SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, logprobs=2)]
    outs = spec.generate([{"prompt_token_ids": p} for p in ids[:3]], mixed, use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [20, 20, 20]
    assert outs[0].outputs[0].token_ids == a[0][0]  # the seeded request's output does not depend on the batch
    assert_no_leak(spec)


def test_refused_combinations(tiny_model_dir):
    model_dir = tiny_model_dir("llama")
    with pytest.raises(ValueError, match="kv_allocator"):
        make_llm(model_dir, kv_allocator="contiguous-oracle", speculative_config=NGRAM)
    with pytest.raises(ValueError, match="unknown key"):
        make_llm(model_dir, speculative_config=dict(NGRAM, num_lookahead_slots=2))
    with pytest.raises(ValueError, match="draft_model"):
        make_llm(model_dir, speculative_config={"method": "draft_model", "num_speculative_tokens": 2})
    # Refused before any rank starts or any weight loads: the message names both settings.
    with pytest.raises(ValueError, match="speculative_config with tensor_parallel_size > 1"):
        make_llm(model_dir, tensor_parallel_size=2, speculative_config=NGRAM)


def _mix_outputs(llm, ids):
    """Forks (n=3, seeded), a beam search and greedy requests on copy-heavy prompts, in a small
    cache that swaps; every output by request."""
    from pagedserve import BeamSearchParams
    engine = llm.llm_engine
    engine.add_request("fork", {"prompt_token_ids": ids[1]},
                       SamplingParams(n=3, temperature=1.0, max_tokens=20, ignore_eos=True, seed=2))
    engine.add_beam_search_request("beam", {"prompt_token_ids": ids[4]},
                                   BeamSearchParams(beam_width=3, max_tokens=12, ignore_eos=True))
    for i in (0, 2, 3):
        engine.add_request(f"g{i}", {"prompt_token_ids": ids[i]},
                           SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True))
    outs = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                outs[o.request_id] = [c.token_ids for c in o.outputs]
    outs["beam"] = [s.tokens for s in engine.pop_beam_search_output("beam").sequences]
    assert_no_leak(llm)
    return outs


@pytest.mark.parametrize("incremental", ["1", "0"])
def test_forks_beams_and_swaps_beside_speculation(pair, monkeypatch, incremental):
    """Requests that cannot speculate keep their outputs beside speculating ones, through swaps;
    both input paths of the runner (incremental device state, and the host rebuild)."""
    monkeypatch.setenv("PAGEDSERVE_INCREMENTAL_INPUTS", incremental)
    model_dir, ids, _, _ = pair
    kw = dict(block_size=4, num_gpu_blocks_override=40, swap_space=0.05, preemption_mode="swap")
    want = _mix_outputs(make_llm(model_dir, **kw), ids)
    llm = make_llm(model_dir, speculative_config=NGRAM, **kw)
    got = _mix_outputs(llm, ids)
    assert got == want
    assert llm.get_kv_cache_stats().num_preemptions > 0
    assert llm.get_spec_decode_stats().num_accepted_tokens > 0
