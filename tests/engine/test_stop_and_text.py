"""Stop rules and output text: stop strings, stop tokens, EOS, min_tokens, multi-byte round trips."""
import pytest

from pagedserve import SamplingParams

from .helpers import assert_no_leak, hf_greedy, make_llm, prompt_ids, tokenizer

N = 24


@pytest.fixture(scope="module")
def setup(tiny_model_dir):
    model_dir = tiny_model_dir("llama")
    llm = make_llm(model_dir, block_size=8)
    ids = prompt_ids(model_dir)
    base = llm.generate([{"prompt_token_ids": p} for p in ids],
                        SamplingParams(temperature=0.0, max_tokens=N, ignore_eos=True), use_tqdm=False)
    return model_dir, llm, ids, base


def test_text_round_trips_multibyte(setup):
    model_dir, llm, ids, base = setup
    tok = tokenizer(str(model_dir))
    multibyte = 0
    for out in base:
        c = out.outputs[0]
        assert c.text == tok.decode(c.token_ids, skip_special_tokens=True)
        multibyte += any(ord(ch) > 127 for ch in c.text)
        assert c.finish_reason == "length"
    assert multibyte > 0
    # String prompts are tokenized by the engine and echoed back.
    text = "Привет, мир! 🚀"
    out = llm.generate(text, SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)[0]
    assert out.prompt == text and out.prompt_token_ids == tok.encode(text)
    assert out.outputs[0].token_ids == hf_greedy(model_dir, tok.encode(text), 4)


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_cuts_the_text(setup, include):
    model_dir, llm, ids, base = setup
    prompts, params, expect = [], [], []
    for p, out in zip(ids, base):
        text = out.outputs[0].text
        # Random weights emit many partial characters (U+FFFD); stop on a clean 2-char window.
        starts = [j for j in range(4, len(text) - 2) if "\ufffd" not in text[j:j + 2]]
        if not starts:
            continue
        stop = text[starts[0]:starts[0] + 2]
        i = text.find(stop)
        prompts.append({"prompt_token_ids": p})
        params.append(SamplingParams(temperature=0.0, max_tokens=N, ignore_eos=True, stop=[stop, "never-seen-xyz"],
                                     include_stop_str_in_output=include))
        expect.append((text[:i + len(stop)] if include else text[:i], stop))
    assert len(prompts) >= 3
    outs = llm.generate(prompts, params, use_tqdm=False)
    for out, (want, stop) in zip(outs, expect):
        c = out.outputs[0]
        assert c.text == want
        assert c.finish_reason == "stop" and c.stop_reason == stop
        assert len(c.token_ids) < N
    assert_no_leak(llm)


def test_stop_token_ids_and_eos(setup):
    model_dir, llm, ids, base = setup
    full = base[0].outputs[0].token_ids
    stop_tok = full[5]
    first = full.index(stop_tok)
    out = llm.generate({"prompt_token_ids": ids[0]},
                       SamplingParams(temperature=0.0, max_tokens=N, stop_token_ids=[stop_tok]), use_tqdm=False)[0]
    c = out.outputs[0]
    assert c.token_ids == full[:first + 1]
    assert c.finish_reason == "stop" and c.stop_reason == stop_tok
    tok = tokenizer(str(model_dir))
    assert c.text == tok.decode(full[:first], skip_special_tokens=True)  # the stop token's text is left out

    # EOS stops (stop_reason None) unless ignore_eos; HF stops at the same place.
    engine = llm.llm_engine
    saved = set(engine.eos_token_ids)
    engine.eos_token_ids.clear()
    engine.eos_token_ids.add(stop_tok)
    try:
        out = llm.generate({"prompt_token_ids": ids[0]}, SamplingParams(temperature=0.0, max_tokens=N),
                           use_tqdm=False)[0].outputs[0]
        assert out.token_ids == full[:first + 1] and out.finish_reason == "stop" and out.stop_reason is None
        # min_tokens masks EOS until reached.
        m = first + 3
        out = llm.generate({"prompt_token_ids": ids[0]}, SamplingParams(temperature=0.0, max_tokens=N, min_tokens=m),
                           use_tqdm=False)[0].outputs[0]
        assert stop_tok not in out.token_ids[:m] and len(out.token_ids) > m
    finally:
        engine.eos_token_ids.clear()
        engine.eos_token_ids.update(saved)
    assert_no_leak(llm)


def test_streaming_outputs_are_cumulative_and_hold_back_stop_prefixes(setup):
    model_dir, llm, ids, base = setup
    text = base[2].outputs[0].text
    stop = text[10:13]
    assert "\ufffd" not in stop
    engine = llm.llm_engine
    engine.add_request("s", {"prompt_token_ids": ids[2]},
                       SamplingParams(temperature=0.0, max_tokens=N, ignore_eos=True, stop=[stop]))
    seen = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            seen.append(out.outputs[0].text)
    final = text[:text.find(stop)]
    assert seen[-1] == final
    for earlier, later in zip(seen, seen[1:]):
        assert later.startswith(earlier)  # a stream never takes text back
    assert_no_leak(llm)


def test_skip_tokenizer_init_gives_token_ids_only(tiny_model_dir):
    model_dir = tiny_model_dir("llama")
    llm = make_llm(model_dir, skip_tokenizer_init=True)
    p = prompt_ids(model_dir)[0]
    out = llm.generate({"prompt_token_ids": p}, SamplingParams(temperature=0.0, max_tokens=5), use_tqdm=False)[0]
    assert out.outputs[0].token_ids == hf_greedy(model_dir, p, 5)
    assert out.outputs[0].text == ""
    with pytest.raises(ValueError, match="prompt"):
        llm.generate("text needs a tokenizer", use_tqdm=False)


def test_without_tokenizer_same_tokens_and_stop_rules(setup):
    """skip_tokenizer_init takes the int-only stop checks; tokens, finish and stop reasons match
    the engine with a tokenizer for stop_token_ids, EOS, max_tokens and min_tokens."""
    model_dir, _, ids, base = setup
    toks = base[0].outputs[0].token_ids
    runs = {}
    for bare in (False, True):
        llm = make_llm(model_dir, block_size=8, skip_tokenizer_init=bare)
        # An EOS the tiny random model actually emits, the same for both engines.
        llm.llm_engine.output_processor.eos_token_ids = {toks[4]}
        cases = [SamplingParams(temperature=0.0, max_tokens=N, stop_token_ids=[toks[2]]),
                 SamplingParams(temperature=0.0, max_tokens=N),
                 SamplingParams(temperature=0.0, max_tokens=3),
                 SamplingParams(temperature=0.0, max_tokens=N, ignore_eos=True, stop_token_ids=[toks[4]]),
                 SamplingParams(temperature=0.0, max_tokens=N, min_tokens=6)]
        runs[bare] = [[(o.outputs[0].token_ids, o.outputs[0].finish_reason, o.outputs[0].stop_reason,
                        round(o.outputs[0].cumulative_logprob, 4))
                       for o in llm.generate([{"prompt_token_ids": p} for p in ids], sp, use_tqdm=False)]
                      for sp in cases]
        assert_no_leak(llm)
    assert runs[True] == runs[False]
    # Every rule fired somewhere: a stop token, EOS, and a length limit.
    kinds = {(fin, type(reason).__name__) for case in runs[True] for _, fin, reason, _ in case}
    assert {("stop", "int"), ("stop", "NoneType"), ("length", "NoneType")} <= kinds
