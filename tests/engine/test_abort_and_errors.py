"""Aborts mid-flight leave no block behind; bad arguments raise ValueError naming the field."""
import pytest

from pagedserve import LLM, BeamSearchParams, SamplingParams

from .helpers import add_fork_beam_mix, assert_no_leak, fork_is_forked, make_llm, prompt_ids


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir):
    return tiny_model_dir("llama")


def test_abort_mid_flight_forked_beam_and_swapped(model_dir):
    ids = prompt_ids(model_dir)
    # Small cache: the mix below is forced into swap preemption while it runs.
    llm = make_llm(model_dir, block_size=4, num_gpu_blocks_override=48, swap_space=0.05, preemption_mode="swap")
    engine = llm.llm_engine
    add_fork_beam_mix(engine, ids, max_tokens=40)  # the fork (n=3) fits the cache alone
    saw_swapped = saw_forked = False
    for _ in range(40):
        engine.step()
        saw_swapped |= engine.scheduler.num_swapped > 0
        saw_forked |= fork_is_forked(engine)
        if saw_swapped and saw_forked and engine.scheduler.num_swapped > 0:
            break
    assert saw_forked and saw_swapped
    assert llm.get_kv_cache_stats().num_blocks_used > 0
    engine.abort_request(["fork", "beam"] + [f"r{i}" for i in range(6)] + ["no-such-request"])
    engine.abort_request("fork")  # twice: quietly ignored
    assert engine.step() == []
    assert_no_leak(llm)
    assert engine.pop_beam_search_output("beam") is None


def test_abort_after_finish_and_unknown_ids_are_quiet(model_dir):
    llm = make_llm(model_dir)
    out = llm.generate({"prompt_token_ids": [5, 6, 7]}, SamplingParams(max_tokens=2), use_tqdm=False)[0]
    llm.llm_engine.abort_request(out.request_id)
    llm.llm_engine.abort_request(["x", "y"])
    assert_no_leak(llm)


@pytest.fixture(scope="module")
def llm(model_dir):
    return make_llm(model_dir, max_model_len=64, num_gpu_blocks_override=8, block_size=16)


@pytest.mark.parametrize("prompt,params,field", [
    ("", None, "prompt"),
    ({"prompt_token_ids": []}, None, "prompt"),
    ({"prompt_token_ids": [1, 2, 100000]}, None, "prompt_token_ids"),
    ({"prompt_token_ids": [1, -1]}, None, "prompt_token_ids"),
    ({"prompt_token_ids": [1, "a"]}, None, "prompt_token_ids"),
    ({"nothing": 1}, None, "prompt"),
    ({"prompt_token_ids": [1] * 60}, SamplingParams(max_tokens=10), "max_model_len"),
    ({"prompt_token_ids": [1] * 64}, SamplingParams(max_tokens=None), "max_model_len"),
    ({"prompt_token_ids": [1, 2]}, SamplingParams(stop_token_ids=[5000]), "stop_token_ids"),
])
def test_bad_requests_raise_naming_the_field(llm, prompt, params, field):
    with pytest.raises(ValueError, match=field):
        llm.generate(prompt, params, use_tqdm=False)
    assert_no_leak(llm)


def test_duplicate_request_id_and_param_checks(llm):
    engine = llm.llm_engine
    engine.add_request("dup", {"prompt_token_ids": [1, 2, 3]}, SamplingParams(max_tokens=3))
    with pytest.raises(ValueError, match="request_id"):
        engine.add_request("dup", {"prompt_token_ids": [1, 2, 3]}, SamplingParams(max_tokens=3))
    engine.abort_request("dup")
    with pytest.raises(ValueError, match="sampling_params"):
        engine.add_request("p", "hello", {"temperature": 0})
    with pytest.raises(ValueError, match="sampling_params"):
        llm.generate(["a", "b"], [SamplingParams()], use_tqdm=False)
    # prompt + max_tokens must fit the 8 x 16 = 128-slot cache... and max_model_len=64 comes first.
    with pytest.raises(ValueError, match="max_tokens"):
        engine.add_request("q", {"prompt_token_ids": [1] * 10}, SamplingParams(max_tokens=60))
    with pytest.raises(ValueError, match="beam_width"):
        BeamSearchParams(beam_width=0, max_tokens=3)
    for kw, field in [(dict(top_p=0.0), "top_p"), (dict(temperature=-1), "temperature"), (dict(n=0), "n"),
                      (dict(n=3, best_of=2), "best_of"), (dict(max_tokens=0), "max_tokens"),
                      (dict(min_tokens=5, max_tokens=2), "min_tokens"), (dict(top_k=-5), "top_k"),
                      (dict(logprobs=-2), "logprobs"), (dict(repetition_penalty=0), "repetition_penalty")]:
        with pytest.raises(ValueError, match=field):
            SamplingParams(**kw)
    # the upper bound is the engine's max_logprobs (20 by default, vLLM's)
    with pytest.raises(ValueError, match=r"logprobs \(99\) must be <= max_logprobs \(20"):
        engine.add_request("lp", {"prompt_token_ids": [1, 2]}, SamplingParams(max_tokens=2, logprobs=99))
    assert_no_leak(llm)


def test_cache_too_small_for_request(model_dir):
    llm = make_llm(model_dir, num_gpu_blocks_override=2, block_size=4)
    with pytest.raises(ValueError, match="KV cache"):
        llm.generate({"prompt_token_ids": [1] * 6}, SamplingParams(max_tokens=4), use_tqdm=False)
    assert_no_leak(llm)


def test_best_of_that_cannot_fit_the_cache_is_refused_not_cut_short(model_dir):
    """n = best_of = 4 of a 180-token prompt, 60 tokens each, in 36 blocks of 8: the prompt's 22 full
    blocks are shared, but each sequence needs 8 of its own (30 - 22), 54 blocks in all. The group
    alone outgrows the cache, so the scheduler would end every sequence at 20 tokens ("length", as if
    max_model_len): refused instead, naming n / best_of, as the server refuses it. With 8 tokens
    each (22 + 4 x 2 = 30 blocks) it fits and runs to the end."""
    llm = make_llm(model_dir, block_size=8, num_gpu_blocks_override=36, max_num_batched_tokens=24)
    prompt = {"prompt_token_ids": [5 + i % 250 for i in range(180)]}
    with pytest.raises(ValueError, match=r"best_of \(4\).*54 KV-cache blocks.*36"):
        llm.generate(prompt, SamplingParams(n=4, temperature=0.8, seed=1, max_tokens=60, ignore_eos=True),
                     use_tqdm=False)
    out = llm.generate(prompt, SamplingParams(n=4, temperature=0.8, seed=1, max_tokens=8, ignore_eos=True),
                       use_tqdm=False)[0]
    assert [(len(c.token_ids), c.finish_reason) for c in out.outputs] == [(8, "length")] * 4
    assert_no_leak(llm)


def test_llm_argument_errors(model_dir):
    with pytest.raises(ValueError, match="not_an_arg"):
        LLM(str(model_dir), not_an_arg=1)
    with pytest.raises(ValueError, match="block_size"):
        LLM(str(model_dir), block_size=0)
    with pytest.raises(ValueError, match="max_model_len"):
        LLM(str(model_dir), device="cpu", max_model_len=100000)
    with pytest.raises(ValueError, match="model"):
        LLM("/nonexistent/dir")


@pytest.mark.parametrize("length", [{}, {"max_model_len": 128}])
def test_a_step_budget_below_max_model_len_without_chunking_fails_before_the_weights_load(model_dir, monkeypatch,
                                                                                        length):
    """Without chunked prefill a prompt runs in one step, so the budget must hold max_model_len (here
    the model's 512 or the 128 asked): refused before the executor is built, not after the weights load."""
    from pagedserve.engine import llm_engine

    def no_executor(*a, **kw):
        raise AssertionError("the executor was built")
    monkeypatch.setattr(llm_engine, "build_executor", no_executor)
    want = length.get("max_model_len", 512)
    with pytest.raises(ValueError, match=rf"max_num_batched_tokens \(64\) must be >= max_model_len \({want}\)"):
        LLM(str(model_dir), device="cpu", enable_chunked_prefill=False, max_num_batched_tokens=64, **length)


def test_bad_tokenizer_path_names_the_field(model_dir, tmp_path):
    with pytest.raises(ValueError, match="tokenizer"):
        LLM(str(model_dir), device="cpu", tokenizer=str(tmp_path / "missing"))


NAN = float("nan")


@pytest.mark.parametrize("kw,field", [
    # wrong types: each once failed as "'<' not supported between ...", naming nothing, or ran as
    # something else (max_tokens=2.5 gave 3 tokens, NaN max_tokens no limit, a float stop token id
    # never matched, "abc" as bad_words banned a, b and c) or failed inside the engine's step.
    (dict(temperature="0.5"), "temperature"), (dict(top_p=None), "top_p"), (dict(min_p="0"), "min_p"),
    (dict(presence_penalty=None), "presence_penalty"), (dict(repetition_penalty="1"), "repetition_penalty"),
    (dict(temperature=True), "temperature"), (dict(top_k=1.5), "top_k"), (dict(top_k=NAN), "top_k"),
    (dict(n=1.5), "n"), (dict(n=2.0), "n"), (dict(best_of="2"), "best_of"), (dict(seed=1.5), "seed"),
    (dict(max_tokens=2.5), "max_tokens"), (dict(max_tokens=NAN), "max_tokens"),
    (dict(max_tokens=float("inf")), "max_tokens"), (dict(min_tokens=NAN), "min_tokens"),
    (dict(min_tokens=None), "min_tokens"), (dict(logprobs=1.5), "logprobs"), (dict(prompt_logprobs="3"), "prompt_logprobs"),
    (dict(stop=5), "stop"), (dict(stop=[5]), "stop"), (dict(stop={"a": 1}), "stop"),
    (dict(stop_token_ids=[1.5]), "stop_token_ids"), (dict(stop_token_ids="ab"), "stop_token_ids"),
    (dict(stop_token_ids=[None]), "stop_token_ids"), (dict(stop_token_ids=[True]), "stop_token_ids"),
    (dict(logit_bias={1: "x"}), "logit_bias"), (dict(logit_bias={1: None}), "logit_bias"),
    (dict(allowed_token_ids=5), "allowed_token_ids"), (dict(bad_words="abc"), "bad_words"),
    (dict(bad_words_token_ids=[[]]), "bad_words_token_ids"), (dict(bad_words_token_ids=[1, 2]), "bad_words_token_ids"),
    (dict(bad_words_token_ids=[[1.5]]), "bad_words_token_ids"),
    (dict(detokenize="no"), "detokenize"), (dict(ignore_eos="no"), "ignore_eos"),
    (dict(skip_special_tokens=None), "skip_special_tokens"),
    (dict(include_stop_str_in_output=1), "include_stop_str_in_output"),
    (dict(structured_outputs="regex"), "structured_outputs"), (dict(structured_outputs={"nosuch": 1}), "structured_outputs"),
    (dict(structured_outputs={"choice": "abc"}), "structured_outputs.choice"),
    (dict(structured_outputs={"regex": 5}), "structured_outputs.regex"),
    (dict(structured_outputs={"json_object": "yes"}), "structured_outputs.json_object"),
])
def test_sampling_params_of_the_wrong_type_name_the_field(kw, field):
    with pytest.raises((TypeError, ValueError), match=rf"^{field} "):
        SamplingParams(**kw)


@pytest.mark.parametrize("kw,field", [
    (dict(beam_width=1.5), "beam_width"), (dict(beam_width="2"), "beam_width"), (dict(beam_width=True), "beam_width"),
    (dict(max_tokens=None), "max_tokens"), (dict(max_tokens=2.5), "max_tokens"), (dict(logprobs=1.5), "logprobs"),
    (dict(length_penalty="1"), "length_penalty"), (dict(ignore_eos="x"), "ignore_eos"),
    (dict(structured_outputs="regex"), "structured_outputs"),
])
def test_beam_search_params_of_the_wrong_type_name_the_field(kw, field):
    with pytest.raises((TypeError, ValueError), match=rf"^{field} "):
        BeamSearchParams(**{"beam_width": 2, "max_tokens": 3, **kw})


def test_numpy_integers_are_integers():
    np = pytest.importorskip("numpy")
    sp = SamplingParams(n=np.int64(2), temperature=0.5, max_tokens=np.int32(3), seed=np.int64(7),
                        stop_token_ids=[np.int64(5)])
    assert (sp.n, sp.max_tokens, sp.seed, sp.stop_token_ids) == (2, 3, 7, [5])
    assert all(type(v) is int for v in (sp.n, sp.best_of, sp.max_tokens, sp.seed, sp.stop_token_ids[0]))


@pytest.mark.parametrize("prompts,sampling,message", [
    (None, None, "prompt must be a string"),
    ([None], None, "prompt must be a string"),
    (b"hello", None, "prompt must be a string"),  # was run as its byte values, taken for token ids
    ([5, "hi"], None, "prompt must be a string"),
    ({"prompt": None}, None, "prompt must be a string"),
    ({"prompt_token_ids": None}, None, "prompt_token_ids"),
    ({"prompt_token_ids": [5], "prompt": 5}, None, "prompt"),
    # vLLM's prompt keys this engine cannot serve, and a misspelt one: once dropped without a word
    ({"prompt": "hi", "multi_modal_data": {"image": 1}}, None, "multi_modal_data"),
    ({"prompt": "hi", "cache_sal": "x"}, None, "cache_sal"),
    (["hi"], {"max_tokens": 3}, "sampling_params must be a SamplingParams or a list"),  # was "got str"
])
def test_malformed_prompts_are_refused_and_the_batch_and_engine_are_unharmed(llm, prompts, sampling, message):
    good = {"prompt_token_ids": [5, 6, 7]}
    greedy = SamplingParams(temperature=0, max_tokens=4)
    before = llm.generate([good], greedy, use_tqdm=False)[0].outputs[0].token_ids
    with pytest.raises(ValueError, match=message):
        if isinstance(prompts, list) and sampling is None:
            llm.generate([good] + prompts, greedy, use_tqdm=False)  # the good one first: taken back
        else:
            llm.generate(prompts, sampling, use_tqdm=False)
    assert_no_leak(llm)
    assert llm.generate([good], greedy, use_tqdm=False)[0].outputs[0].token_ids == before


@pytest.mark.parametrize("kw,error,match", [
    # each once failed as "'<' not supported between 'str' and 'int'", torch's "manual_seed
    # expected a long" (a RuntimeError), "cannot convert float NaN to integer", or was taken:
    # max_model_len=1.5, max_num_seqs=1.5, and "no" for a bool as True
    (dict(block_size=1.5), TypeError, "block_size must be an integer"),
    (dict(block_size="16"), TypeError, "block_size must be an integer"),
    (dict(gpu_memory_utilization="x"), TypeError, "gpu_memory_utilization must be a number"),
    (dict(max_model_len=1.5), TypeError, "max_model_len must be an integer or None"),
    (dict(max_num_seqs=1.5), TypeError, "max_num_seqs must be an integer or None"),
    (dict(swap_space=float("nan")), ValueError, "swap_space must be a finite number"),
    (dict(swap_space=float("inf")), ValueError, "swap_space must be a finite number"),
    (dict(seed=None), TypeError, "seed must be an integer"),
    (dict(seed=1.5), TypeError, "seed must be an integer"),
    (dict(seed=2**70), ValueError, "seed must be in"),
    (dict(enable_prefix_caching="no"), TypeError, "enable_prefix_caching must be a bool"),
    (dict(max_logprobs=1.5), TypeError, "max_logprobs must be an integer"),
])
def test_engine_arguments_of_the_wrong_type_name_the_argument(model_dir, kw, error, match):
    from pagedserve.config import EngineConfig
    with pytest.raises(error, match=match):
        EngineConfig(model=str(model_dir), device="cpu", **kw)
    with pytest.raises(error, match=match):
        LLM(str(model_dir), device="cpu", **kw)


def test_a_torch_dtype_is_taken_by_its_name(model_dir):
    """LLM(dtype=torch.float16) as vLLM takes it: the same engine as dtype="float16" (the config
    keeps names; a torch.dtype there was "dtype must be a string")."""
    import torch
    by_dtype = LLM(str(model_dir), device="cpu", dtype=torch.bfloat16, num_gpu_blocks_override=8)
    assert by_dtype.llm_engine.config.dtype == "bfloat16"
    assert next(by_dtype.llm_engine.runner.model.parameters()).dtype == torch.bfloat16
    with pytest.raises(ValueError, match="dtype must be auto"):
        LLM(str(model_dir), device="cpu", dtype=torch.int8)
