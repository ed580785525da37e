"""Structured outputs in the engine (engine/structured/, issue #32), against the demo model.

The demo model knows no JSON (it writes King James prose), so a schema-valid output is the
grammar at work. Sampling is on (temperature 1, seeds) throughout. Every output that finished
with "stop" (the grammar closed) must validate against its schema with jsonschema, match its
regex / choice / grammar; most outputs must finish that way (max_tokens is chosen so they close).
"""
import json
import re

import jsonschema
import pytest

from pagedserve import SamplingParams
from pagedserve.demo_model import DEMO_MODEL_DIR
from pagedserve.engine.core import EngineCore
from pagedserve.sampling_params import BeamSearchParams, StructuredOutputsParams as SO

from .helpers import assert_no_leak, make_llm

PROMPTS = ["In the beginning", "And God said", "The LORD is my shepherd", "Blessed are"]
FORMATS = jsonschema.Draft202012Validator.FORMAT_CHECKER

SCHEMAS = [
    # nested objects, bounded string, integer bounds
    {"type": "object", "additionalProperties": False, "required": ["person"],
     "properties": {"person": {"type": "object", "required": ["name", "age"], "additionalProperties": False,
                               "properties": {"name": {"type": "string", "minLength": 1, "maxLength": 8},
                                              "age": {"type": "integer", "minimum": 18, "maximum": 99}}}}},
    # array of enums with minItems / maxItems
    {"type": "object", "required": ["tags"], "additionalProperties": False,
     "properties": {"tags": {"type": "array", "minItems": 2, "maxItems": 3,
                             "items": {"type": "string", "enum": ["lamb", "lion", "dove"]}}}},
    # anyOf
    {"anyOf": [{"type": "integer", "minimum": -5, "maximum": 5},
               {"type": "object", "required": ["ok"], "additionalProperties": False,
                "properties": {"ok": {"type": "boolean"}}}]},
    # nullable types
    {"type": "object", "required": ["a", "b"], "additionalProperties": False,
     "properties": {"a": {"type": ["string", "null"], "maxLength": 4}, "b": {"type": ["integer", "null"], "minimum": 0, "maximum": 999}}},
    # pattern and number bounds
    {"type": "object", "required": ["id", "p"], "additionalProperties": False,
     "properties": {"id": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{3}$"},
                    "p": {"type": "number", "minimum": 0, "maximum": 1}}},
    # formats
    {"type": "object", "required": ["day", "ip"], "additionalProperties": False,
     "properties": {"day": {"type": "string", "format": "date"}, "ip": {"type": "string", "format": "ipv4"}}},
    # enum / const at the top level
    {"enum": ["Genesis", "Exodus", 3, None]},
    # array of small objects
    {"type": "array", "minItems": 1, "maxItems": 2,
     "items": {"type": "object", "required": ["v"], "additionalProperties": False,
               "properties": {"v": {"type": "integer", "minimum": 0, "maximum": 9}}}},
]


@pytest.fixture(scope="module")
def llm():
    llm = make_llm(DEMO_MODEL_DIR, num_gpu_blocks_override=256)
    yield llm
    llm.shutdown()


def _json_params(schema, seed, **kw):
    kw.setdefault("max_tokens", 48)
    return SamplingParams(temperature=1.0, seed=seed,
                          structured_outputs=SO(json=schema, disable_any_whitespace=True), **kw)


def _assert_mostly_stop(outputs, checks):
    """checks[i](text) must hold for every output of request i that the grammar closed ("stop");
    the others ran into max_tokens; at least 80% of all outputs closed."""
    stopped = total = 0
    for o, check in zip(outputs, checks):
        for c in o.outputs:
            total += 1
            if c.finish_reason == "stop":
                assert check(c.text) is not False, c.text
                stopped += 1
            else:
                assert c.finish_reason == "length", c
    assert stopped >= 0.8 * total, f"only {stopped} of {total} outputs closed their grammar"


def _validator(schema):
    def check(text):
        jsonschema.validate(json.loads(text), schema, format_checker=FORMATS)
    return check


def test_json_schemas_validate(llm):
    reqs = [(s, 0) for s in SCHEMAS] + [(s, 1) for s in SCHEMAS[:4]]
    outs = llm.generate([PROMPTS[i % len(PROMPTS)] for i in range(len(reqs))],
                        [_json_params(s, seed) for s, seed in reqs], use_tqdm=False)
    _assert_mostly_stop(outs, [_validator(schema) for schema, _ in reqs])
    # Sampling really ran: different seeds of one schema give different documents somewhere.
    n = len(SCHEMAS)
    assert any(outs[i].outputs[0].text != outs[n + i].outputs[0].text for i in range(4))
    assert_no_leak(llm)


def test_json_object_and_any_whitespace(llm):
    """json_object (any object) and a schema with free whitespace between tokens (the default)."""
    schema = {"type": "object", "required": ["n"], "additionalProperties": False,
              "properties": {"n": {"type": "integer"}}}
    params = [SamplingParams(temperature=1.0, seed=s, max_tokens=32, structured_outputs=SO(json_object=True))
              for s in range(2)]
    params += [SamplingParams(temperature=0.7, seed=s, max_tokens=32, structured_outputs=SO(json=schema))
               for s in range(2)]
    outs = llm.generate(PROMPTS[:1] * len(params), params, use_tqdm=False)
    for o in outs[:2]:
        c = o.outputs[0]
        if c.finish_reason == "stop":
            assert isinstance(json.loads(c.text), dict)
        else:  # cut by max_tokens: what was written is still the start of an object
            assert c.text.lstrip().startswith("{")
    for o in outs[2:]:
        c = o.outputs[0]
        if c.finish_reason == "stop":
            jsonschema.validate(json.loads(c.text), schema)


def test_json_whitespace_is_bounded_per_gap():
    """structured_outputs_max_whitespace caps a gap between JSON tokens: the grammar takes that many
    whitespace characters and refuses one more (spaces and newlines alike); 0 leaves it unbounded,
    as vLLM does; disable_any_whitespace still allows none."""
    import xgrammar as xgr
    from transformers import AutoTokenizer
    from pagedserve.engine.structured.compiler import parse_spec
    tok = AutoTokenizer.from_pretrained(DEMO_MODEL_DIR)
    compiler = xgr.GrammarCompiler(xgr.TokenizerInfo.from_huggingface(tok, vocab_size=len(tok)))
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}

    def takes(spec, cap, text):
        return xgr.GrammarMatcher(compiler.compile_grammar(parse_spec(spec, cap))).accept_string(text)
    spec = SO(json=schema)
    assert takes(spec, 5, "{" + " \n" * 2 + "\n")
    assert not takes(spec, 5, "{" + " \n" * 3)
    assert takes(spec, 5, '{"a":' + "\n" * 5 + "1}")
    assert not takes(spec, 5, '{"a":' + "\n" * 6)
    assert takes(spec, 0, "{" + "\n" * 500)
    assert takes(SO(json_object=True), 3, "{" + " " * 3) and not takes(SO(json_object=True), 3, "{" + " " * 4)
    assert not takes(SO(json=schema, disable_any_whitespace=True), 5, "{ ")


def test_structured_outputs_engine_options_are_checked():
    from pagedserve.config import EngineConfig
    for field, bad, words in (("structured_outputs_max_whitespace", -1, ">= 0 (0: unbounded)"),
                              ("structured_outputs_fill_threads", 0, ">= 1"),
                              ("structured_outputs_compile_timeout_s", 0.0, "> 0")):
        with pytest.raises(ValueError, match=re.escape(f"{field} must be {words}")):
            EngineConfig(model=str(DEMO_MODEL_DIR), **{field: bad})


def test_bounded_whitespace_lets_a_newline_loving_model_close_its_json():
    """The demo model, asked for JSON with free whitespace, writes newlines for as long as the
    grammar lets it: unbounded (0, vLLM's behaviour) it runs to max_tokens with the object open;
    with a bound (20) every gap fills and the model must go on, so the object closes and
    validates. The default is vLLM's: unbounded."""
    schema = {"type": "object", "required": ["name", "reign"], "additionalProperties": False,
              "properties": {"name": {"type": "string", "maxLength": 12},
                             "reign": {"type": "integer", "minimum": 1, "maximum": 60}}}
    params = [SamplingParams(temperature=1.0, seed=s, max_tokens=160, structured_outputs=SO(json=schema))
              for s in range(3)]
    for cap, closes in ((None, False), (20, True)):
        kw = {} if cap is None else {"structured_outputs_max_whitespace": cap}
        llm = make_llm(DEMO_MODEL_DIR, num_gpu_blocks_override=256, **kw)
        try:
            outs = llm.generate(["Name a king of Israel:"] * 3, params, use_tqdm=False)
        finally:
            llm.shutdown()
        reasons = [o.outputs[0].finish_reason for o in outs]
        if closes:
            assert reasons == ["stop"] * 3, reasons
            for o in outs:
                jsonschema.validate(json.loads(o.outputs[0].text), schema)
        else:
            assert reasons == ["length"] * 3, [o.outputs[0].text[:80] for o in outs]


def test_regex_choice_and_ebnf(llm):
    regex = r"(Psalm|Proverb) [1-9][0-9]?:[1-9][0-9]?"
    choices = ["yea", "nay", 'he said "amen"\n', "selah\\"]
    ebnf = 'root ::= verse (" " verse)?\nverse ::= ("fear" | "love" | "hope") " " [a-z]{1,6} "."'
    params = []
    for seed in range(3):
        params += [SamplingParams(temperature=1.0, seed=seed, max_tokens=24, structured_outputs=SO(regex=regex)),
                   SamplingParams(temperature=1.0, seed=seed, max_tokens=24, structured_outputs=SO(choice=choices)),
                   SamplingParams(temperature=1.0, seed=seed, max_tokens=40, structured_outputs=SO(grammar=ebnf))]
    outs = llm.generate([PROMPTS[i % 4] for i in range(len(params))], params, use_tqdm=False)
    ebnf_re = r"(fear|love|hope) [a-z]{1,6}\.( (fear|love|hope) [a-z]{1,6}\.)?"
    checks = [lambda t: bool(re.fullmatch(regex, t)), lambda t: t in choices, lambda t: bool(re.fullmatch(ebnf_re, t))]
    _assert_mostly_stop(outs, checks * 3)


def test_every_sampling_option_sees_the_mask(llm):
    """Penalties, top-k / top-p / min-p, min_tokens and logprobs (the synchronous torch sampler)
    all act on the masked logits: the output still matches, and every chosen token's logprob is
    finite (it is one the grammar allowed)."""
    regex = r"[a-z]{3,6}( [a-z]{3,6}){0,2}"
    params = [SamplingParams(temperature=1.3, seed=s, top_k=7, top_p=0.9, min_p=0.05, repetition_penalty=1.4,
                             presence_penalty=0.8, frequency_penalty=0.5, min_tokens=3, logprobs=2, max_tokens=24,
                             structured_outputs=SO(regex=regex)) for s in range(3)]
    outs = llm.generate(PROMPTS[:3], params, use_tqdm=False)
    _assert_mostly_stop(outs, [lambda t: bool(re.fullmatch(regex, t))] * 3)
    for o in outs:
        c = o.outputs[0]
        assert all(lp[t].logprob > float("-inf") for t, lp in zip(c.token_ids, c.logprobs))


def test_structural_tag(llm):
    """xgrammar's structural tag: a tagged region with constrained content (what tool calls use)."""
    tag = {"type": "structural_tag", "format": {"type": "tag", "begin": "<call>",
                                                "content": {"type": "regex", "pattern": "[0-9]{2}"},
                                                "end": "</call>"}}
    outs = llm.generate(PROMPTS[:2], [SamplingParams(temperature=1.0, seed=s, max_tokens=16,
                                                     structured_outputs=SO(structural_tag=tag)) for s in range(2)],
                        use_tqdm=False)
    _assert_mostly_stop(outs, [lambda t: bool(re.fullmatch(r"<call>[0-9]{2}</call>", t))] * 2)


def test_greedy_never_takes_a_forbidden_token(llm):
    """Greedy: the model's favourite first token (prose) is forbidden, the output still matches."""
    free = llm.generate(PROMPTS[:1], SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)[0]
    out = llm.generate(PROMPTS[:1], SamplingParams(temperature=0.0, max_tokens=8,
                                                   structured_outputs=SO(regex="[0-9]{4}")), use_tqdm=False)[0]
    assert not free.outputs[0].text[:1].isdigit()
    assert re.fullmatch("[0-9]{4}", out.outputs[0].text) and out.outputs[0].finish_reason == "stop"


def test_n_best_of_and_beam_search(llm):
    schema = SCHEMAS[1]

    valid = _validator(schema)
    outs = llm.generate(PROMPTS[:2], [_json_params(schema, 3, n=3), _json_params(schema, 4, n=1, best_of=2)],
                        use_tqdm=False)
    assert len(outs[0].outputs) == 3 and len(outs[1].outputs) == 1
    _assert_mostly_stop(outs, [valid, valid])
    assert len({c.text for c in outs[0].outputs}) > 1  # three forks, three draws
    beams = llm.beam_search([PROMPTS[2]], BeamSearchParams(
        beam_width=2, max_tokens=40, structured_outputs=SO(json=schema, disable_any_whitespace=True)))[0]
    assert len(beams.sequences) == 2
    narrowed = False
    for b in beams.sequences:
        assert b.finish_reason == "stop", b
        valid(b.output_text)
        # Each step's logprobs leave out what the grammar forbids (-inf); the chosen token is there.
        assert len(b.logprobs) == len(b.output_tokens)
        assert all(v.logprob > float("-inf") for d in b.logprobs for v in d.values())
        assert sum(d[t].logprob for t, d in zip(b.output_tokens, b.logprobs)) == pytest.approx(b.cum_logprob)
        narrowed |= any(len(d) < 4 for d in b.logprobs)  # fewer allowed tokens than 2 * beam_width
    assert narrowed
    assert_no_leak(llm)
    assert not llm.llm_engine.structured.seqs.by_seq  # every matcher freed


def _mix():
    """Seeded constrained requests of up to 40 tokens each (schemas that close within ~35 tokens),
    and two unconstrained neighbours."""
    reqs = [(PROMPTS[i % 4], _json_params(SCHEMAS[k], 10 + i, max_tokens=40)) for i, k in enumerate((1, 4, 7, 2))]
    reqs += [(p, SamplingParams(temperature=1.0, seed=7, max_tokens=32, ignore_eos=True)) for p in PROMPTS[:2]]
    return reqs


@pytest.fixture(scope="module")
def unpreempted(llm):
    tokens, _ = _run_tokens(llm, _mix())
    assert llm.get_kv_cache_stats().num_preemptions == 0
    return tokens


def _run_tokens(llm, reqs):
    outs = llm.generate([p for p, _ in reqs], [sp for _, sp in reqs], use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs], outs


@pytest.mark.parametrize("mode,async_scheduling", [("recompute", True), ("swap", True), ("recompute", False)])
def test_preempted_grammar_requests_match_an_unpreempted_run(unpreempted, mode, async_scheduling):
    """A small cache forces preemption mid-generation; the matcher state survives it: the tokens
    equal a run without preemption (overlapped steps, in the module's engine), token for token,
    with overlapped steps and with synchronous ones."""
    small = make_llm(DEMO_MODEL_DIR, block_size=4, num_gpu_blocks_override=20, swap_space=0.05,
                     preemption_mode=mode, max_num_batched_tokens=32, async_scheduling=async_scheduling)
    engine = small.llm_engine
    schedule, overlapped = engine.scheduler.schedule, [0]

    def spy():  # counts steps planned around a constrained sequence's placeholder token
        out = schedule()
        overlapped[0] += any(s.seq.num_inflight_tokens and s.seq.seq_id in engine.structured.seqs
                             for s in out.scheduled)
        return out
    engine.scheduler.schedule = spy
    try:
        got, outs = _run_tokens(small, _mix())
        assert small.get_kv_cache_stats().num_preemptions > 0
        # Grammar requests keep overlapped steps on (their masks wait for the token in flight).
        assert overlapped[0] > 10 if async_scheduling else overlapped[0] == 0
        assert got == unpreempted
        assert sum(o.outputs[0].finish_reason == "stop" for o in outs) >= 3  # the grammars closed
        assert_no_leak(small)
        assert not small.llm_engine.structured.seqs.by_seq
    finally:
        small.shutdown()


def test_overlap_fill_gives_the_same_tokens(unpreempted, monkeypatch):
    """PAGEDSERVE_GRAMMAR_FILL=overlap: a helper thread appends the previous step's tokens while
    the step loop fills the masks; the draws equal the inline fill's, token for token. The spies
    check the arrangement: the helper's processing starts while the loop is inside the fill (the
    spied fill waits up to 0.5 s for it: a fill started before or after would not see it), and
    each processing ends before its mask is applied (it sleeps 2 ms: without the join, apply()
    would run first)."""
    import threading
    import time
    monkeypatch.setenv("PAGEDSERVE_GRAMMAR_FILL", "overlap")
    llm = make_llm(DEMO_MODEL_DIR, num_gpu_blocks_override=256)
    engine = llm.llm_engine
    st = engine.structured
    process, advance_and_fill, fill, apply = engine._process_inflight, st.advance_and_fill, st._fill, st.apply
    state = {"expect_helper": False, "filling": False, "processing": 0, "on_helper": 0, "beside_fill": 0,
             "applied_while_processing": 0}
    started = threading.Event()

    def process_spy(*args):
        if threading.current_thread() is threading.main_thread():
            return process(*args)
        state["on_helper"] += 1
        state["beside_fill"] += state["filling"]
        state["processing"] += 1
        started.set()
        try:
            time.sleep(0.002)
            return process(*args)
        finally:
            state["processing"] -= 1

    def advance_and_fill_spy(rows, alongside=None):
        state["expect_helper"] = alongside is not None
        return advance_and_fill(rows, alongside)

    def fill_spy(live, bitmask):
        state["filling"] = True
        try:
            fill(live, bitmask)
            if state["expect_helper"]:
                started.wait(0.5)
        finally:
            state["filling"] = False
            started.clear()

    def apply_spy(logits, mask):
        state["applied_while_processing"] += state["processing"] > 0
        return apply(logits, mask)
    engine._process_inflight, st._fill, st.apply = process_spy, fill_spy, apply_spy
    st.advance_and_fill = advance_and_fill_spy
    try:
        got, _ = _run_tokens(llm, _mix())
        assert got == unpreempted
        assert state["on_helper"] > 10, state
        # All but the first: starting the helper's thread lets it run before that fill begins.
        assert state["beside_fill"] >= state["on_helper"] - 1, state
        assert state["applied_while_processing"] == 0, state
        assert_no_leak(llm)
        assert not st.seqs.by_seq
    finally:
        llm.shutdown()


def test_fill_pool_gives_the_same_tokens(llm, monkeypatch):
    """PAGEDSERVE_GRAMMAR_FILL_POOL=1: 12 constrained rows (the threaded fill's from 8) fill on the
    FillPool's long-lived threads; the draws equal the module engine's (the pool off), token for
    token, and the engine's shutdown joins the workers."""
    import threading
    monkeypatch.setenv("PAGEDSERVE_GRAMMAR_FILL_POOL", "1")
    reqs = [(PROMPTS[i % 4], _json_params(SCHEMAS[1], 30 + i, max_tokens=24)) for i in range(12)]
    expect, _ = _run_tokens(llm, reqs)
    pooled = make_llm(DEMO_MODEL_DIR, num_gpu_blocks_override=256, structured_outputs_fill_threads=2)
    pool = pooled.llm_engine.structured._fill_pool
    fills = []
    pool_fill = pool.fill
    pool.fill = lambda ms, bitmask, indices: (fills.append(len(ms)), pool_fill(ms, bitmask, indices))
    pooled.llm_engine.structured._fill_threaded = pool.fill
    try:
        got, _ = _run_tokens(pooled, reqs)
        assert got == expect
        assert len(fills) > 10 and max(fills) == 12, fills
        assert any(t.name.startswith("grammar-fill-") for t in threading.enumerate())
    finally:
        pooled.shutdown()
    assert not any(t.name.startswith("grammar-fill-") for t in threading.enumerate())


def test_grammar_fill_mode_is_checked(monkeypatch):
    from pagedserve.engine.structured.manager import grammar_fill_mode
    monkeypatch.setenv("PAGEDSERVE_GRAMMAR_FILL", "sideways")
    with pytest.raises(ValueError, match="PAGEDSERVE_GRAMMAR_FILL must be one of inline, overlap"):
        grammar_fill_mode()
    monkeypatch.delenv("PAGEDSERVE_GRAMMAR_FILL")
    assert grammar_fill_mode() == "inline"


def test_tensor_parallel_rank0_masks_for_every_rank(unpreempted):
    """TP=2 (gloo on CPU): rank 0 masks its logits, samples and broadcasts the ids, so every rank
    continues from the same constrained draw; the tokens equal the single-rank run's."""
    tp = make_llm(DEMO_MODEL_DIR, tensor_parallel_size=2, num_gpu_blocks_override=256)
    try:
        got, _ = _run_tokens(tp, _mix())
        assert got == unpreempted
    finally:
        tp.shutdown()


def test_bad_specs_are_value_errors(llm):
    for spec, words in ((SO(json={"type": "frob"}), "json"), (SO(json="{not json"), "not valid JSON"),
                        (SO(json={"type": "object", "minProperties": "two"}), "not a valid JSON Schema"),
                        (SO(regex="(unclosed"), "regex"), (SO(grammar="root ::= missing"), "grammar"),
                        (SO(json={"type": "object"}, whitespace_pattern=r"\s*"), "whitespace_pattern")):
        with pytest.raises(ValueError, match=re.escape(words)):
            llm.generate(PROMPTS[:1], SamplingParams(max_tokens=4, structured_outputs=spec), use_tqdm=False)
    assert_no_leak(llm)


# (schema, a JSON text that breaks it, the keyword the refusal names): xgrammar 0.2.9 takes each
# schema and accepts the text.
LOOSE_SCHEMAS = [
    ({"not": {"type": "integer"}}, "4", "`not`"),
    ({"type": "object", "if": {"required": ["a"]}, "then": {"required": ["b"]},
      "additionalProperties": {"type": "integer"}}, '{"a": 1}', "`if`"),
    ({"type": "array", "items": {"type": "integer"}, "contains": {"const": 5}}, "[1]", "`contains`"),
    ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, "[1, 1]", "`uniqueItems`"),
    ({"type": "object", "dependentRequired": {"a": ["b"]}, "additionalProperties": {"type": "integer"}},
     '{"a": 1}', "`dependentRequired`"),
    ({"type": "number", "multipleOf": 0.5}, "0.3", "`multipleOf`"),
    ({"allOf": [{"type": "integer"}, {"minimum": 3}]}, "1", "`allOf`"),
    ({"type": "integer", "anyOf": [{"minimum": 3}, {"maximum": -3}]}, "0", "`type` beside `anyOf`"),
    ({"type": "object", "properties": {"a": {"$ref": "http://example.com/int.json"}}, "required": ["a"]},
     '{"a": "x"}', "http://example.com/int.json"),  # followed by no one: anything goes
]


@pytest.mark.parametrize("schema,breaks,words", LOOSE_SCHEMAS, ids=[w for _, _, w in LOOSE_SCHEMAS])
def test_schema_keywords_xgrammar_does_not_enforce_are_refused(schema, breaks, words):
    """A schema the grammar would only loosely follow is a ValueError naming the keyword and
    where it is, not a grammar that lets the output break it. Each case is checked to be loose
    in xgrammar itself: once a newer xgrammar enforces one, this says to stop refusing it."""
    import xgrammar as xgr
    from xgrammar.testing import _is_grammar_accept_string
    from pagedserve.engine.structured.compiler import parse_spec
    if not words.startswith("http"):  # (a remote reference is not fetched: no reference verdict)
        assert not jsonschema.Draft202012Validator(schema).is_valid(json.loads(breaks))
    grammar = xgr.Grammar.from_json_schema(json.dumps(schema), strict_mode=True)
    assert _is_grammar_accept_string(grammar, breaks), "xgrammar enforces this now: stop refusing it"
    with pytest.raises(ValueError, match=re.escape(words)) as e:
        parse_spec(SO(json=schema))
    assert str(e.value).startswith("structured_outputs.json uses ")


def test_a_schema_nested_too_deep_is_refused_before_it_recurses():
    from pagedserve.engine.structured.compiler import parse_spec
    from pagedserve.sampling_params import MAX_SCHEMA_DEPTH
    deep = {"type": "string"}
    for _ in range(100):
        deep = {"anyOf": [deep, {"type": "null"}]}
    with pytest.raises(ValueError, match=f"at most {MAX_SCHEMA_DEPTH} levels"):
        parse_spec(SO(json=deep))
    with pytest.raises(ValueError, match="not valid JSON"):
        parse_spec(SO(json="[" * 3000 + "]" * 3000))
    ok = {"type": "string"}
    for _ in range(MAX_SCHEMA_DEPTH // 2 - 1):  # two levels of nesting each
        ok = {"anyOf": [ok, {"type": "null"}]}
    parse_spec(SO(json=ok))


def test_an_engine_behind_the_server_does_not_check_schemas_again(monkeypatch):
    """The API server has run jsonschema's meta-schema check (~7 ms per KB) and the
    unenforced-keyword walk off its event loop; the engine core ran them again on its step
    thread, stalling every request in flight. With schemas_checked (LLMEngine(specs_checked=True))
    it does not (its compile thread converts the schema without them); offline it still does."""
    from types import SimpleNamespace
    import torch
    from transformers import AutoTokenizer
    from pagedserve.engine.structured import compiler
    from pagedserve.engine.structured.manager import StructuredOutputs

    def meta_check(schema):
        raise AssertionError("jsonschema's meta-schema check ran")

    def keyword_walk(schema):
        raise AssertionError("the unenforced-keyword walk ran")
    monkeypatch.setattr(compiler, "_check_schema", meta_check)
    monkeypatch.setattr(compiler, "unenforced_keyword", keyword_walk)
    tok = AutoTokenizer.from_pretrained(DEMO_MODEL_DIR)
    spec = SO(json={"type": "object", "properties": {"a": {"type": "integer"}}})
    served = StructuredOutputs(tok, len(tok), {tok.eos_token_id}, torch.device("cpu"), schemas_checked=True)
    try:
        group = SimpleNamespace(request_id="r", seqs=[])
        assert served.check(spec) is None
        assert served.submit(group, spec, None) is False
        served.pending["r"].future.result(timeout=60)  # (an AssertionError above would be raised here)
        assert served.poll() == ([group], [])
    finally:
        served.shutdown()
    offline = StructuredOutputs(tok, len(tok), {tok.eos_token_id}, torch.device("cpu"))
    with pytest.raises(ValueError, match="meta-schema check ran"):  # (parse_spec wraps what it raises)
        offline.check(spec)
    monkeypatch.setattr(compiler, "_check_schema", lambda schema: None)
    with pytest.raises(ValueError, match="keyword walk ran"):
        offline.check(spec)


def test_behind_the_server_the_spec_is_parsed_on_the_compile_thread(monkeypatch):
    """xgrammar's conversion of a new JSON schema takes ~6.5 ms at 33 KB; on the step thread it
    stalled every request in flight, though the server had parsed the spec already. With
    schemas_checked, check() parses nothing and the pool parses on its compile thread, once per
    spec key (a second request for the spec is a cache hit: not parsed again); without, check()
    parses on the caller's thread as before."""
    import threading
    from types import SimpleNamespace
    import torch
    from transformers import AutoTokenizer
    from pagedserve.engine.structured import manager
    from pagedserve.engine.structured.manager import StructuredOutputs

    threads = []
    real = manager.parse_spec

    def counting(*args, **kw):
        threads.append(threading.get_ident())
        return real(*args, **kw)
    monkeypatch.setattr(manager, "parse_spec", counting)
    tok = AutoTokenizer.from_pretrained(DEMO_MODEL_DIR)
    spec = SO(json={"type": "object", "properties": {"b": {"type": "string", "maxLength": 4}}})
    served = StructuredOutputs(tok, len(tok), {tok.eos_token_id}, torch.device("cpu"), schemas_checked=True)
    try:
        first, second = SimpleNamespace(request_id="1", seqs=[]), SimpleNamespace(request_id="2", seqs=[])
        assert served.check(spec) is None and threads == []
        assert served.submit(first, spec, None) is False
        served.pending["1"].future.result(timeout=60)
        assert served.poll() == ([first], [])
        assert len(threads) == 1 and threads[0] != threading.get_ident()
        assert served.check(spec) is None and served.submit(second, spec, None) is True  # cached
        assert len(threads) == 1 and served.pool.stats.cache_hits == 1 and served.pool.stats.compiles == 1
    finally:
        served.shutdown()
    offline = StructuredOutputs(tok, len(tok), {tok.eos_token_id}, torch.device("cpu"))
    assert offline.check(spec) is not None and threads[1:] == [threading.get_ident()]


def test_behind_the_server_a_spec_that_fails_to_parse_fails_its_request_alone():
    """The server parsed every spec, but should one still fail in the core (it parses with the
    engine's whitespace bound, or a cache raced), that request ends as a failed compile does
    ("abort", an error naming the spec's problem) while the others complete; add_request does
    not raise and the step loop goes on."""
    from pagedserve.config import EngineConfig
    config = EngineConfig(model=str(DEMO_MODEL_DIR), device="cpu", dtype="float32", swap_space=0.01,
                          num_gpu_blocks_override=64)
    core = EngineCore(config, serving=True, specs_checked=True)
    engine = core.engine
    try:
        core.add_request("bad", PROMPTS[0], SamplingParams(max_tokens=4,
                                                           structured_outputs=SO(regex="(unclosed")))
        core.add_request("good", PROMPTS[1], SamplingParams(temperature=0.0, max_tokens=8,
                                                            structured_outputs=SO(regex="[a-c]{3}")))
        core.add_request("free", PROMPTS[2], SamplingParams(temperature=0.0, max_tokens=4))
        finals = {}
        while engine.has_unfinished_requests():
            finals.update((o.request_id, o) for o in core.step() if o.finished)
        assert finals["bad"].outputs[0].finish_reason == "abort"
        # parse_spec's own words, as the direct path's ValueError says them (not "failed to compile: ...")
        assert finals["bad"].error.startswith("structured_outputs.regex cannot be compiled"), finals["bad"].error
        assert re.fullmatch("[a-c]{3}", finals["good"].outputs[0].text), finals["good"]
        assert finals["good"].error is None and finals["free"].error is None
        assert finals["free"].outputs[0].finish_reason == "length"
        # Parsed on the compile thread, the failure is not cached: the spec is tried again.
        core.add_request("bad2", PROMPTS[3], SamplingParams(max_tokens=4,
                                                           structured_outputs=SO(regex="(unclosed")))
        while engine.has_unfinished_requests():
            finals.update((o.request_id, o) for o in core.step() if o.finished)
        assert "structured_outputs.regex" in finals["bad2"].error
    finally:
        core.shutdown()


def test_schemas_xgrammar_enforces_whole_are_not_refused():
    from pagedserve.engine.structured.compiler import parse_spec
    for schema in ({"type": "object", "properties": {"not": {"type": "string"}, "if": {"type": "integer"}}},
                   {"anyOf": [{"type": "string"}, {"type": "null"}], "default": None, "title": "X"},
                   {"$ref": "#/$defs/C", "description": "d", "$defs": {"C": {"enum": ["a", "b"]}}},
                   {"type": "integer", "multipleOf": 3}, {"type": ["integer", "null"], "multipleOf": 2},
                   {"allOf": [{"type": "integer"}]},
                   {"enum": [{"not": 1}]}, {"type": "array", "items": {"type": "integer"}, "uniqueItems": False}):
        parse_spec(SO(json=schema))


def test_skip_tokenizer_init_refuses_structured_outputs():
    llm = make_llm(DEMO_MODEL_DIR, skip_tokenizer_init=True, num_gpu_blocks_override=32)
    try:
        with pytest.raises(ValueError, match="skip_tokenizer_init"):
            llm.generate([[0, 5, 6]], SamplingParams(max_tokens=4, structured_outputs=SO(regex="a+")),
                         use_tqdm=False)
    finally:
        llm.shutdown()


def test_slow_compile_fails_alone_and_metrics_count():
    """A grammar that compiles for about 3 s against a 0.5 s limit: that request ends with "abort"
    and an error naming the limit; its neighbours, constrained (a regex compiling in ~3 ms) or not,
    complete. The margins are wide both ways because the outcome is decided by the clock: with a
    0.05 s limit the quick regex itself timed out while the whole suite loaded the machine. The
    compile, cache-hit and compile-time counters reach EngineCore's snapshot (what /metrics reads)."""
    core = EngineCore(None, engine=make_llm(DEMO_MODEL_DIR, num_gpu_blocks_override=64,
                                            structured_outputs_compile_timeout_s=0.5).llm_engine)
    engine = core.engine
    slow = SO(json={"enum": [f"verse{i}-" * 3 for i in range(6000)]})
    quick = SO(regex="[a-c]{3}")
    try:
        before = core.snapshot()
        core.add_request("slow", PROMPTS[0], SamplingParams(max_tokens=8, structured_outputs=slow))
        core.add_request("free", PROMPTS[1], SamplingParams(temperature=0.0, max_tokens=8))
        core.add_request("q1", PROMPTS[2], SamplingParams(temperature=0.0, max_tokens=8, structured_outputs=quick))
        finals = {}
        while engine.has_unfinished_requests():
            for o in core.step():
                if o.finished:
                    finals[o.request_id] = o
            if "q1" in finals and not engine.has_request("q2") and "q2" not in finals:
                core.add_request("q2", PROMPTS[3], SamplingParams(temperature=0.0, max_tokens=8,
                                                                  structured_outputs=quick))
        assert finals["slow"].outputs[0].finish_reason == "abort"
        assert "structured_outputs_compile_timeout_s" in finals["slow"].error
        assert finals["free"].outputs[0].finish_reason == "length" and finals["free"].error is None
        for rid in ("q1", "q2"):
            assert re.fullmatch("[a-c]{3}", finals[rid].outputs[0].text), finals[rid]
        after = core.snapshot()
        assert after.structured_output_compiles >= before.structured_output_compiles + 1
        assert after.structured_output_cache_hits >= before.structured_output_cache_hits + 1  # q2 reused q1's
        assert sum(after.structured_output_compile_seconds_buckets) == after.structured_output_compiles
        assert after.structured_output_compile_seconds_sum > 0
    finally:
        core.shutdown()


def test_a_new_compile_meets_its_deadline_whichever_thread_ran_first():
    """A new compile waits for poll(), which weighs it against its deadline first, even when the
    compile thread has finished before submit() looks (here: a compile run inline): past a 1 us
    limit it fails, as it does when the step thread looks first. A spec compiled already starts
    at once (no deadline: nothing is compiled)."""
    from concurrent.futures import Future
    from types import SimpleNamespace
    import torch
    from transformers import AutoTokenizer
    from pagedserve.engine.structured.manager import StructuredOutputs

    class Inline:  # an executor whose futures are done before submit() returns
        def submit(self, fn, *args):
            fut = Future()
            fut.set_result(fn(*args))
            return fut
    tok = AutoTokenizer.from_pretrained(DEMO_MODEL_DIR)
    so = StructuredOutputs(tok, len(tok), {tok.eos_token_id}, torch.device("cpu"), compile_timeout_s=1e-6)
    so.pool._pool = Inline()
    spec = SO(regex="[a-z]+")
    late = SimpleNamespace(request_id="late", seqs=[])
    assert so.submit(late, spec, so.check(spec)) is False
    ready, failed = so.poll()
    assert ready == [] and [g for g, _ in failed] == [late]
    assert "structured_outputs_compile_timeout_s" in failed[0][1]
    again = SimpleNamespace(request_id="again", seqs=[])
    assert so.submit(again, spec, so.check(spec)) is True and "again" in so.compiled


def test_two_process_engine_serves_grammars_and_reports_them():
    """Behind the server (core in its own process): the spec crosses the process boundary (a dict
    schema, streamed DELTA outputs concatenate to a valid document), a bad spec is the core's
    ValueError, a compile past the limit fails that request alone with RequestOutput.error, and
    the compile counters reach /metrics."""
    import asyncio

    from pagedserve.config import EngineConfig
    from pagedserve.engine.async_engine import AsyncLLMEngine
    from pagedserve.sampling_params import RequestOutputKind

    schema = SCHEMAS[1]
    config = EngineConfig(model=str(DEMO_MODEL_DIR), device="cpu", dtype="float32", swap_space=0.01,
                          num_gpu_blocks_override=64, structured_outputs_compile_timeout_s=0.5)
    engine = AsyncLLMEngine.from_engine_config(config)

    async def collect(rid, params):
        return [o async for o in engine.generate(PROMPTS[0], params, rid)]

    async def go():
        try:
            with pytest.raises(ValueError, match="structured_outputs.regex"):
                await engine.add_request("bad", PROMPTS[0], SamplingParams(
                    max_tokens=4, structured_outputs=SO(regex="(unclosed")))
            # No server in front checked it: the core walks the schema for unenforced keywords.
            with pytest.raises(ValueError, match="uses `not`"):
                await engine.add_request("loose", PROMPTS[0], SamplingParams(
                    max_tokens=4, structured_outputs=SO(json={"not": {"type": "string"}})))
            streamed, slow = await asyncio.gather(
                collect("json", _json_params(schema, 5, output_kind=RequestOutputKind.DELTA)),
                collect("slow", SamplingParams(max_tokens=4, structured_outputs=SO(
                    json={"enum": [f"verse{i}+" * 3 for i in range(6000)]}))))
            text = "".join(o.outputs[0].text for o in streamed if o.outputs)
            assert streamed[-1].outputs[0].finish_reason == "stop"
            jsonschema.validate(json.loads(text), schema)
            assert slow[-1].finished and slow[-1].outputs[0].finish_reason == "abort"
            assert "structured_outputs_compile_timeout_s" in slow[-1].error
            await collect("again", _json_params(schema, 6))  # the same spec: a cache hit
            metrics = engine.metrics.render().decode()

            def value(name):
                return float(re.search(rf"^pagedserve:{name} (\S+)$", metrics, re.M).group(1))
            # json compiled; "slow" too if its compile has ended by now (it runs on after the timeout)
            assert value("structured_output_compiles_total") in (1.0, 2.0)
            assert value("structured_output_cache_hits_total") == 1.0  # "again"
            assert value("structured_output_compile_seconds_count") == value("structured_output_compiles_total")
        finally:
            await engine.shutdown()
    asyncio.run(go())


def test_two_process_engine_for_the_server_fails_a_bad_spec_in_its_request():
    """AsyncLLMEngine.from_engine_config(specs_checked=True), as the API server starts it: the
    core leaves the parse to its compile thread, so a spec that still fails there is no
    ValueError from add_request but that request's error output, beside a request that completes."""
    import asyncio

    from pagedserve.config import EngineConfig
    from pagedserve.engine.async_engine import AsyncLLMEngine

    config = EngineConfig(model=str(DEMO_MODEL_DIR), device="cpu", dtype="float32", swap_space=0.01,
                          num_gpu_blocks_override=64)
    engine = AsyncLLMEngine.from_engine_config(config, specs_checked=True)

    async def collect(rid, params):
        return [o async for o in engine.generate(PROMPTS[0], params, rid)]

    async def go():
        try:
            bad, good = await asyncio.gather(
                collect("bad", SamplingParams(max_tokens=4, structured_outputs=SO(regex="(unclosed"))),
                collect("good", SamplingParams(temperature=0.0, max_tokens=8,
                                               structured_outputs=SO(regex="[a-c]{3}"))))
            assert bad[-1].finished and bad[-1].outputs[0].finish_reason == "abort"
            assert "structured_outputs.regex" in bad[-1].error
            assert good[-1].error is None and re.fullmatch("[a-c]{3}", good[-1].outputs[0].text)
        finally:
            await engine.shutdown()
    asyncio.run(go())


def test_compile_cache_is_bounded_by_entries_and_bytes():
    from pagedserve.engine.structured.compiler import GrammarCompilerPool, parse_spec

    from .helpers import tokenizer
    pool = GrammarCompilerPool(tokenizer(str(DEMO_MODEL_DIR)), 2048, [1], threads=1, cache_size=3)
    specs = [SO(regex=f"[a-z]{{{i}}}") for i in range(1, 6)]
    for spec in specs:
        pool.submit(spec.key(), parse_spec(spec)).result()
    pool._evict()
    assert len(pool._cache) == 3 and all(pool.has(s.key()) for s in specs[2:]) and not pool.has(specs[0].key())
    one = pool._bytes[specs[4].key()]
    assert one > 0
    pool._cache_limit_bytes = one  # room for one grammar
    pool._evict()
    assert list(pool._cache) == [specs[4].key()]
    pool.shutdown()
