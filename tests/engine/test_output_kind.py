"""Output shapes: step(final_only=True), and SamplingParams.output_kind (CUMULATIVE, DELTA,
FINAL_ONLY) — DELTA outputs joined back together equal the CUMULATIVE ones exactly."""
import dataclasses
import random

import pytest

from pagedserve import RequestOutputKind, SamplingParams

from .helpers import assert_no_leak, hf_greedy, make_llm, prompt_ids, tokenizer

N = 12


def _run(engine, prompts, params, final_only):
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", {"prompt_token_ids": p}, params)
    seen: dict[str, list] = {}
    while engine.has_unfinished_requests():
        for out in engine.step(final_only=final_only):
            seen.setdefault(out.request_id, []).append(out)
    return seen


def test_final_only_outputs_once_and_equals_the_stream(tiny_model_dir):
    model_dir = tiny_model_dir("llama")
    # No prefix caching: the second run then computes exactly what the first did.
    llm = make_llm(model_dir, block_size=4, enable_prefix_caching=False)
    prompts = prompt_ids(model_dir)[:3]
    params = SamplingParams(temperature=0.0, max_tokens=N, ignore_eos=True, stop=["the"])
    stream = _run(llm.llm_engine, prompts, params, final_only=False)
    final = _run(llm.llm_engine, prompts, params, final_only=True)
    for i, p in enumerate(prompts):
        s, f = stream[f"r{i}"], final[f"r{i}"]
        # The stream reports every step it advanced, growing by one token, and finishes last.
        assert [len(o.outputs[0].token_ids) for o in s] == list(range(1, len(s) + 1))
        assert [o.finished for o in s] == [False] * (len(s) - 1) + [True]
        # final_only reports exactly once, when finished, with the same result.
        assert len(f) == 1 and f[0].finished
        assert f[0].outputs[0] == s[-1].outputs[0]
        assert f[0].outputs[0].token_ids == hf_greedy(model_dir, p, N, ignore_eos=True)[:len(s)]
    assert_no_leak(llm)


# ---- SamplingParams.output_kind: CUMULATIVE (default), DELTA, FINAL_ONLY -----------------------

M = 16


def _kind_run(engine, prompts, params_list, kind, final_only=False):
    """Every output of every request, run alone in the engine with output_kind=kind."""
    for i, (p, sp) in enumerate(zip(prompts, params_list)):
        engine.add_request(f"k{i}", {"prompt_token_ids": p}, dataclasses.replace(sp, output_kind=kind))
    seen: dict[str, list] = {}
    while engine.has_unfinished_requests():
        for out in engine.step(final_only=final_only):
            seen.setdefault(out.request_id, []).append(out)
    return [seen[f"k{i}"] for i in range(len(prompts))]


def _joined(deltas):
    """Per index: the DELTA outputs of one request joined back together, plus how often each
    index reported a finish_reason."""
    joined: dict[int, dict] = {}
    for out in deltas:
        for c in out.outputs:
            j = joined.setdefault(c.index, {"token_ids": [], "text": "", "logprobs": [], "finishes": 0,
                                            "last": None})
            assert j["finishes"] == 0, "nothing may follow a sequence's finish_reason"
            j["token_ids"] += c.token_ids
            j["text"] += c.text
            j["logprobs"] += c.logprobs or []
            j["finishes"] += c.finish_reason is not None
            j["last"] = c
    return joined


def _assert_delta_equals_cumulative(deltas, cumulative, logprobs):
    final = cumulative[-1]
    assert final.finished and deltas[-1].finished
    assert not any(o.finished for o in deltas[:-1])
    joined = _joined(deltas)
    assert sorted(joined) == [c.index for c in final.outputs]
    for c in final.outputs:
        j = joined[c.index]
        assert j["token_ids"] == c.token_ids
        assert j["text"] == c.text
        assert (j["logprobs"] if logprobs else None) == c.logprobs
        assert j["finishes"] == 1
        last = j["last"]
        # Whole-request values, not deltas.
        assert (last.finish_reason, last.stop_reason, last.cumulative_logprob) == \
            (c.finish_reason, c.stop_reason, c.cumulative_logprob)


def _prompts(model_dir):
    rng = random.Random(7)
    vocab = len(tokenizer(str(model_dir)))
    rand = [[rng.randrange(3, vocab) for _ in range(rng.randrange(2, 30))] for _ in range(4)]
    return prompt_ids(model_dir) + rand


@pytest.fixture(scope="module")
def kinds_setup(tiny_model_dir):
    model_dir = tiny_model_dir("llama")
    llm = make_llm(model_dir, block_size=4, enable_prefix_caching=False)
    prompts = _prompts(model_dir)
    base = _kind_run(llm.llm_engine, prompts,
                     [SamplingParams(temperature=0.0, max_tokens=M, ignore_eos=True)] * len(prompts),
                     RequestOutputKind.CUMULATIVE)
    # Stop strings from the middle of each text, beside a long one never seen: text is held
    # back (up to 13 characters) while it could still start a stop string.
    params = []
    for outs in base:
        text = outs[-1].outputs[0].text
        starts = [j for j in range(3, len(text) - 2) if "\ufffd" not in text[j:j + 2]]
        stop = [text[starts[0]:starts[0] + 2]] if starts else []
        params.append(SamplingParams(temperature=0.0, max_tokens=M, ignore_eos=True, logprobs=2,
                                     stop=stop + ["never-seen-xyz"]))
    return model_dir, llm, prompts, params


def test_delta_joins_to_cumulative_step_by_step(kinds_setup):
    model_dir, llm, prompts, params = kinds_setup
    engine = llm.llm_engine
    cum = _kind_run(engine, prompts, params, RequestOutputKind.CUMULATIVE)
    delta = _kind_run(engine, prompts, params, "delta")
    tok = tokenizer(str(model_dir))
    stopped = held = split_chars = 0
    for d, c in zip(delta, cum):
        _assert_delta_equals_cumulative(d, c, logprobs=True)
        # Step by step, each delta is exactly what the cumulative output added that step.
        assert len(d) == len(c)
        prev_ids, prev_text = [], ""
        for dk, ck in zip(d, c):
            cd, cc = dk.outputs[0], ck.outputs[0]
            assert cd.token_ids == cc.token_ids[len(prev_ids):]
            assert cd.text == cc.text[len(prev_text):]
            assert cd.logprobs == cc.logprobs[len(prev_ids):]
            held += bool(cd.token_ids) and not cd.text and not cd.finish_reason
            # A token holding only part of a multi-byte character decodes to U+FFFD alone.
            split_chars += sum("\ufffd" in tok.decode([t]) for t in cd.token_ids)
            prev_ids, prev_text = cc.token_ids, cc.text
        stopped += c[-1].outputs[0].finish_reason == "stop"
    # The cases this test is about did occur: stop strings cut the text, characters split
    # across tokens, and steps whose token added no text yet (a held stop prefix or an
    # incomplete character).
    assert stopped >= 3 and held > 0 and split_chars > 0
    assert_no_leak(llm)


def test_delta_with_n_and_include_stop_str(kinds_setup):
    _, llm, prompts, params = kinds_setup
    engine = llm.llm_engine
    sampled = [dataclasses.replace(p, n=3, best_of=None, temperature=1.0, seed=11 + i,
                                   include_stop_str_in_output=i % 2 == 1)
               for i, p in enumerate(params[:6])]
    cum = _kind_run(engine, prompts[:6], sampled, RequestOutputKind.CUMULATIVE)
    delta = _kind_run(engine, prompts[:6], sampled, RequestOutputKind.DELTA)
    for d, c in zip(delta, cum):
        assert len(c[-1].outputs) == 3
        _assert_delta_equals_cumulative(d, c, logprobs=True)
        # A delta carries only the streams that advanced: O(new) per step.
        for out in d:
            assert all(o.token_ids or o.text or o.finish_reason for o in out.outputs)
    assert_no_leak(llm)


def test_final_only_kind_reports_once_equal_to_cumulative(kinds_setup):
    _, llm, prompts, params = kinds_setup
    engine = llm.llm_engine
    cum = _kind_run(engine, prompts, params, RequestOutputKind.CUMULATIVE)
    final = _kind_run(engine, prompts, params, RequestOutputKind.FINAL_ONLY)
    # step(final_only=True) with DELTA requests: one output, everything in it.
    delta_final = _kind_run(engine, prompts, params, RequestOutputKind.DELTA, final_only=True)
    for c, f, df in zip(cum, final, delta_final):
        assert len(f) == 1 and f[0].finished and f[0].outputs == c[-1].outputs
        assert len(df) == 1 and df[0].outputs == c[-1].outputs
    assert_no_leak(llm)


def test_output_kind_bad_values_name_the_field():
    assert SamplingParams(output_kind="final_only").output_kind is RequestOutputKind.FINAL_ONLY
    assert SamplingParams().output_kind is RequestOutputKind.CUMULATIVE
    with pytest.raises(ValueError, match="output_kind"):
        SamplingParams(output_kind="partial")
    with pytest.raises(ValueError, match="best_of"):
        SamplingParams(n=1, best_of=2, output_kind=RequestOutputKind.DELTA)
    # best_of > n stays fine where the ranking is only read at the end.
    for kind in ("cumulative", "final_only"):
        SamplingParams(n=1, best_of=2, output_kind=kind)
