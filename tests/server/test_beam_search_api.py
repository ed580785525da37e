"""vLLM's use_beam_search on the server: the choices are LLM.beam_search's hypotheses, best first,
which are HF transformers' generate(num_beams=n, early_stopping=True); completions (several
prompts), chat (streamed too), length_penalty, include_stop_str_in_output, a grammar; the
combinations a beam search cannot serve are 400s naming the field; a plain request beside a
running search gets its own, correct result. Logprobs: test_beam_search_logprobs.py."""
from __future__ import annotations

import json
import threading
import time

import httpx
import pytest

from beam_server import CHAT, CMPL, MAX_NUM_SEQS, chat_prompt, expected, hf_beams, post
from beam_server import http, llm, model, server  # noqa: F401 (fixtures)
from engine.helpers import hf_greedy, prompt_ids, tokenizer
from pagedserve import BeamSearchParams
from pagedserve.sampling_params import StructuredOutputsParams


@pytest.mark.parametrize("length_penalty", [1.0, 0.0, 2.0])
def test_completions_equal_offline_and_hf(http, model, llm, length_penalty):
    """Several prompts in one request: n choices each, in prompt order, best first."""
    prompts = prompt_ids(model[0])[:3]
    n, max_tokens = 3, 8
    body = post(http, CMPL, prompt=prompts, n=n, max_tokens=max_tokens, use_beam_search=True,
                length_penalty=length_penalty)
    choices = body["choices"]
    assert [c["index"] for c in choices] == list(range(n * len(prompts)))
    completion_tokens = 0
    ended_by_eos = 0
    for i, p in enumerate(prompts):
        out, want = expected(model, llm, p, n, max_tokens, length_penalty)
        assert [s.output_tokens for s in out.sequences] == hf_beams(model[0], p, model[1], n, max_tokens,
                                                                    length_penalty)
        got = [(c["text"], c["finish_reason"]) for c in choices[i * n:(i + 1) * n]]
        assert got == [(t, f) for t, f, _ in want]
        assert all(c["logprobs"] is None for c in choices)
        completion_tokens += sum(k for _, _, k in want)
        ended_by_eos += sum(f == "stop" for _, f, _ in want)
    assert ended_by_eos > 0
    assert body["usage"] == {"prompt_tokens": sum(map(len, prompts)), "completion_tokens": completion_tokens,
                             "total_tokens": sum(map(len, prompts)) + completion_tokens}


def test_completions_text_prompt_echo_and_stop_token_kept(http, model, llm):
    """A text prompt, echo (the prompt before each choice's text), include_stop_str_in_output:
    the EOS counts in usage, its text stays out (as vLLM's server does); ignore_eos: all "length"."""
    text = "The quick brown fox"
    ids = tokenizer(str(model[0]))(text).input_ids
    body = post(http, CMPL, prompt=text, n=2, max_tokens=8, use_beam_search=True, echo=True,
                include_stop_str_in_output=True)
    _, want = expected(model, llm, ids, 2, 8, include_stop=True)
    assert [(c["text"], c["finish_reason"]) for c in body["choices"]] == [(text + t, f) for t, f, _ in want]
    assert body["usage"]["completion_tokens"] == sum(k for _, _, k in want)
    assert any(f == "stop" for _, f, _ in want)
    body = post(http, CMPL, prompt=ids, n=2, max_tokens=5, use_beam_search=True, ignore_eos=True)
    _, want = expected(model, llm, ids, 2, 5, ignore_eos=True)
    assert [(c["text"], c["finish_reason"]) for c in body["choices"]] == [(t, f) for t, f, _ in want]
    assert body["usage"]["completion_tokens"] == 10


def test_temperature_leaves_the_scores_raw(http, model, llm):
    """temperature (unset: 1.0, vLLM's default) reaches BeamSearchParams but not the scores: vLLM's
    LLM.beam_search ranks by the raw logprobs of its one-token requests (V1's raw_logprobs mode), as
    HF's num_beams ranks without do_sample. At 0.25 and 4.0 the beams are HF's, and offline's."""
    ids = prompt_ids(model[0])[3]
    hf = hf_beams(model[0], ids, model[1], 3, 8, 1.0)
    for t in (None, 0.25, 4.0):
        body = post(http, CMPL, prompt=ids, n=3, max_tokens=8, use_beam_search=True,
                    **({} if t is None else {"temperature": t}))
        out, want = expected(model, llm, ids, 3, 8, temperature=1.0 if t is None else t)
        assert [s.output_tokens for s in out.sequences] == hf
        assert [(c["text"], c["finish_reason"]) for c in body["choices"]] == [(x, f) for x, f, _ in want]


def test_chat_equals_offline_streamed_or_not(http, model, llm):
    messages = [{"role": "user", "content": "Paged attention stores the KV cache"}]
    ids = chat_prompt(http, messages)
    out, want = expected(model, llm, ids, 3, 7, 0.5)
    assert [s.output_tokens for s in out.sequences] == hf_beams(model[0], ids, model[1], 3, 7, 0.5)
    req = dict(messages=messages, n=3, max_completion_tokens=7, use_beam_search=True, length_penalty=0.5)
    body = post(http, CHAT, **req)
    assert [(c["index"], c["message"]["content"], c["finish_reason"]) for c in body["choices"]] == \
        [(i, t, f) for i, (t, f, _) in enumerate(want)]
    assert body["usage"] == {"prompt_tokens": len(ids), "completion_tokens": sum(k for _, _, k in want),
                             "total_tokens": len(ids) + sum(k for _, _, k in want)}
    # Streamed (vLLM streams a chat beam search): each choice's role first, then each choice whole,
    # then usage; one choice a chunk, as vLLM's and OpenAI's.
    with http.stream("POST", CHAT, json={"model": "tiny", **req, "stream": True,
                                         "stream_options": {"include_usage": True}}) as r:
        assert r.status_code == 200
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert [c["choices"] for c in chunks[:3]] == [[{"index": i, "delta": {"role": "assistant", "content": ""},
                                                   "logprobs": None, "finish_reason": None, "stop_reason": None}]
                                                 for i in range(3)]
    assert all(len(c["choices"]) == 1 for c in chunks[:-1])
    text, finish = {}, {}
    for ch in chunks[3:-1]:
        for c in ch["choices"]:
            text[c["index"]] = text.get(c["index"], "") + c["delta"].get("content", "")
            finish[c["index"]] = c["finish_reason"] or finish.get(c["index"])
    assert [(text[i], finish[i]) for i in range(3)] == [(t, f) for t, f, _ in want]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == body["usage"]


def test_a_grammar_constrains_every_beam(http, model, llm):
    """structured_outputs (pagedserve's BeamSearchParams carries it; vLLM drops it): every beam
    follows the grammar, the same beams as offline."""
    choice = ["yes", "no", "maybe so"]
    ids = prompt_ids(model[0])[1]
    body = post(http, CMPL, prompt=ids, n=2, max_tokens=8, use_beam_search=True,
                structured_outputs={"choice": choice})
    _, want = expected(model, llm, ids, 2, 8, structured_outputs=StructuredOutputsParams(choice=choice))
    assert [(c["text"], c["finish_reason"]) for c in body["choices"]] == [(t, f) for t, f, _ in want]
    assert all(c["text"] in choice for c in body["choices"])


def test_a_grammar_that_leaves_every_beam_no_token_is_a_400(http):
    """A mask that forbids every token gave NaN logprobs, which were kept as candidates: the beams
    went on with tokens the grammar refused (a 200 of text breaking it). Now such tokens are no
    candidates, and a search left with none and no finished hypothesis is a 400 saying why."""
    for grammar, after in (("root ::= root", 0), ('root ::= "a" x\nx ::= x', 1)):
        for path, base in ((CMPL, {"prompt": "hello"}), (CHAT, {"messages": [{"role": "user", "content": "hi"}]})):
            r = http.post(path, json={"model": "tiny", **base, "max_tokens": 6, "use_beam_search": True, "n": 2,
                                      "structured_outputs": {"grammar": grammar}})
            assert r.status_code == 400, r.text
            err = r.json()["error"]
            assert err["code"] == "structured_outputs_failed" and f"after {after} output tokens" in err["message"], err
            assert err["param"] == "structured_outputs.grammar", err  # the field that set the grammar
        # streamed (chat; completions refuse a streamed beam search): the error event names it too
        with http.stream("POST", CHAT, json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}],
                                             "max_tokens": 6, "use_beam_search": True, "n": 2, "stream": True,
                                             "structured_outputs": {"grammar": grammar}}) as s:
            events = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: {")]
        err = events[-1]["error"]
        assert err["code"] == "structured_outputs_failed" and err["param"] == "structured_outputs.grammar", events


BEAM = {"use_beam_search": True, "n": 2}
P = {"prompt": "hello", "max_tokens": 3}
M = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
REFUSED = [  # (path, body, param)
    *[(path, {**base, **BEAM, name: value}, name) for path, base in ((CMPL, P), (CHAT, M))
      for name, value in [("top_p", 0.5), ("top_k", 5), ("min_p", 0.1), ("presence_penalty", 0.5),
                          ("frequency_penalty", 0.5), ("repetition_penalty", 1.2), ("min_tokens", 1),
                          ("stop", ["x"]), ("stop", "x"), ("stop_token_ids", [5]), ("logit_bias", {"5": 1.0}),
                          ("bad_words", ["x"]), ("allowed_token_ids", [5]), ("prompt_logprobs", 1),
                          ("spaces_between_special_tokens", False)]],
    # logprobs are served (test_beam_search_logprobs.py) within --max-logprobs (20), as for sampling
    (CMPL, {**P, **BEAM, "logprobs": 21}, "logprobs"),
    (CHAT, {**M, **BEAM, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    (CMPL, {**P, **BEAM, "logprobs": 1, "echo": True}, "echo"),  # the search computes no prompt logprobs
    (CMPL, {**P, **BEAM, "best_of": 3}, "best_of"),
    (CMPL, {**P, **BEAM, "max_tokens": 0, "echo": True}, "max_tokens"),
    (CMPL, {**P, **BEAM, "n": MAX_NUM_SEQS + 1}, "n"),
    (CHAT, {**M, **BEAM, "n": MAX_NUM_SEQS + 1}, "n"),
    (CMPL, {**P, "length_penalty": 0.5}, "length_penalty"),
    (CHAT, {**M, "length_penalty": 2.0}, "length_penalty"),
    # len ** length_penalty would overflow (or reach 0 and divide) in the engine's step, failing
    # every request in flight with a 500
    (CMPL, {**P, **BEAM, "length_penalty": 1e308}, "length_penalty"),
    (CHAT, {**M, **BEAM, "length_penalty": -1e308}, "length_penalty"),
]


@pytest.mark.parametrize("path,body,param", REFUSED, ids=[f"{p[4:8]}-{k}" for p, _, k in REFUSED])
def test_what_a_beam_search_cannot_serve_is_a_400_naming_it(http, path, body, param):
    r = http.post(path, json={"model": "tiny", **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.text
    assert param in r.json()["error"]["message"]


def test_length_penalty_at_its_bounds_is_served(http):
    from pagedserve.sampling_params import MAX_LENGTH_PENALTY
    for lp in (-MAX_LENGTH_PENALTY, MAX_LENGTH_PENALTY):
        body = post(http, CMPL, **P, **BEAM, length_penalty=lp)
        assert len(body["choices"]) == 2


def test_priority_reaches_the_engine(http):
    """priority is the request's, as for sampling: this first-come-first-served server refuses
    any other than 0, naming it (a search that dropped it would run)."""
    for path, base in ((CMPL, P), (CHAT, M)):
        r = http.post(path, json={"model": "tiny", **base, **BEAM, "priority": 1})
        assert r.status_code == 400 and r.json()["error"]["param"] == "priority", r.text
        post(http, path, **base, **BEAM, priority=0)


def test_streamed_completions_are_refused_in_vllms_words(http):
    r = http.post(CMPL, json={"model": "tiny", **P, **BEAM, "stream": True})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["message"] == "Streaming is not currently supported with beam search"
    assert err["param"] == "use_beam_search"


def test_no_op_values_are_accepted(http):
    """Values that change nothing pass: best_of = n, the sampling knobs' neutral values, a seed
    (a beam search draws nothing), length_penalty 1 without a beam search."""
    noop = dict(best_of=2, top_p=1.0, top_k=-1, min_p=0.0, presence_penalty=0.0, frequency_penalty=0.0,
                repetition_penalty=1.0, min_tokens=0, stop=[], stop_token_ids=[], logit_bias={}, bad_words=[],
                seed=7, use_beam_search=True, n=2)
    a = post(http, CMPL, **P, **noop)
    b = post(http, CMPL, **P, use_beam_search=True, n=2)
    assert [c["text"] for c in a["choices"]] == [c["text"] for c in b["choices"]]
    post(http, CMPL, **P, length_penalty=1.0)
    post(http, CHAT, **M, use_beam_search=False, length_penalty=1.0)


def test_a_plain_request_beside_a_running_search(server, http, model, llm):
    """The core steps the search and a plain request together: the plain one (short) ends first,
    with its HF greedy tokens; the search ends with LLM.beam_search's beams."""
    prompts = prompt_ids(model[0])
    beam_prompt, plain_prompt = prompts[5], prompts[0]
    beam_body = dict(prompt=beam_prompt, n=4, max_tokens=60, ignore_eos=True, use_beam_search=True)
    done: dict[str, tuple[float, dict]] = {}

    def run_beam():
        with httpx.Client(base_url=server.base_url, timeout=120) as c:
            r = c.post(CMPL, json={"model": "tiny", **beam_body})
            done["beam"] = (time.monotonic(), r.json())

    t = threading.Thread(target=run_beam)
    t.start()
    try:
        deadline = time.monotonic() + 60
        while server.metrics().get("vllm:num_requests_running", 0) < 1:  # the search is running
            assert time.monotonic() < deadline and t.is_alive()
            time.sleep(0.02)
        plain = post(http, CMPL, prompt=plain_prompt, max_tokens=4, temperature=0.0, ignore_eos=True)
        done["plain"] = (time.monotonic(), plain)
    finally:
        t.join()
    tok = tokenizer(str(model[0]))
    assert plain["choices"][0]["text"] == tok.decode(hf_greedy(model[0], plain_prompt, 4, ignore_eos=True),
                                                     skip_special_tokens=True)
    assert done["plain"][0] < done["beam"][0]
    _, want = expected(model, llm, beam_prompt, 4, 60, ignore_eos=True)
    assert [(c["text"], c["finish_reason"]) for c in done["beam"][1]["choices"]] == [(t, f) for t, f, _ in want]



def test_unset_temperature_takes_the_generation_config():
    """As vLLM: the request's temperature, else the model's generation config's, else 1.0."""
    from pagedserve.entrypoints.openai.beam_search import beam_search_params
    from pagedserve.entrypoints.openai.protocol import CompletionRequest
    req = CompletionRequest(prompt="x", use_beam_search=True, n=3, length_penalty=0.5)
    assert beam_search_params(req, 9, {"temperature": 0.7}, None) == BeamSearchParams(
        beam_width=3, max_tokens=9, temperature=0.7, length_penalty=0.5)
    assert beam_search_params(req, 9, {}, None).temperature == 1.0
    req = CompletionRequest(prompt="x", use_beam_search=True, temperature=0.0, ignore_eos=True)
    assert beam_search_params(req, 9, {"temperature": 0.7}, None) == BeamSearchParams(
        beam_width=1, max_tokens=9, temperature=0.0, ignore_eos=True)


def test_output_text_and_tokens(model):
    """text_output.beam_search_output: skip_special_tokens as asked, the EOS of a "stop"
    hypothesis never in the text, in token_ids only with include_stop_str_in_output."""
    from pagedserve.engine.text_output import beam_search_output
    from pagedserve.outputs import CompletionOutput, RequestOutput
    tok = tokenizer(str(model[0]))
    body = tok("Hello there").input_ids[1:]  # without its BOS
    core = RequestOutput("r", None, [5], [CompletionOutput(0, "", [*body, 0, *body, 1], -1.0, None, "stop", 1),
                                          CompletionOutput(1, "", [*body, 0], -2.0, None, "length")], True)
    skip, keep = beam_search_output(core, tok), beam_search_output(core, tok, skip_special_tokens=False)
    assert [c.text for c in skip.outputs] == [tok.decode(body + body, skip_special_tokens=True),
                                              tok.decode(body, skip_special_tokens=True)]
    assert [c.text for c in keep.outputs] == [tok.decode([*body, 0, *body]), tok.decode([*body, 0])]
    assert "<s>" in keep.outputs[0].text and "</s>" not in keep.outputs[0].text
    assert [c.token_ids for c in skip.outputs] == [[*body, 0, *body], [*body, 0]]
    kept = beam_search_output(core, tok, include_stop_str_in_output=True)
    assert [c.token_ids for c in kept.outputs] == [[*body, 0, *body, 1], [*body, 0]]
    assert [c.text for c in kept.outputs] == [c.text for c in skip.outputs]
    assert [(c.finish_reason, c.stop_reason, c.cumulative_logprob) for c in kept.outputs] == \
        [("stop", 1, -1.0), ("length", None, -2.0)]


def test_start_beam_passes_the_output_fields():
    """The request's skip_special_tokens (or the tool parser's override), include_stop_str_in_output,
    priority and cache_salt reach AsyncLLMEngine.add_beam_search_request."""
    import asyncio

    from pagedserve.entrypoints.openai.protocol import CompletionRequest
    from pagedserve.entrypoints.openai.serving_common import OpenAIServing

    class Engine:
        async def add_beam_search_request(self, *args, **kw):
            self.call = (args, kw)
    engine = Engine()
    serving = OpenAIServing(engine, "tiny")
    params = BeamSearchParams(beam_width=2, max_tokens=3)
    req = CompletionRequest(prompt="x", use_beam_search=True, skip_special_tokens=False,
                            include_stop_str_in_output=True, priority=3, cache_salt="s")
    asyncio.run(serving.start_beam([7, 8], params, "r", req))
    assert engine.call == (("r", {"prompt_token_ids": [7, 8], "cache_salt": "s"}, params, 3),
                           {"skip_special_tokens": False, "include_stop_str_in_output": True})
    req = CompletionRequest(prompt="x", use_beam_search=True)
    asyncio.run(serving.start_beam([7], params, "r", req, skip_special_tokens=False))
    assert engine.call == (("r", {"prompt_token_ids": [7]}, params, 0),
                           {"skip_special_tokens": False, "include_stop_str_in_output": False})


def test_forced_tool_calls_are_beams_too(tools_http):
    """tools with a named tool_choice: its grammar constrains every beam and each choice's text
    is parsed into tool_calls, as for sampling (the demo model, hermes parser)."""
    import jsonschema
    zone = {"type": "string", "pattern": "^[A-Z][a-z]{2,8}/[A-Z][a-z]{2,8}$"}
    schema = {"type": "object", "properties": {"timezone": zone}, "required": ["timezone"],
              "additionalProperties": False}
    tools = [{"type": "function", "function": {"name": "get_time", "parameters": schema}}]
    r = tools_http.post(CHAT, json={
        "messages": [{"role": "user", "content": "What time is it in Paris?"}], "tools": tools, "n": 2,
        "tool_choice": {"type": "function", "function": {"name": "get_time"}}, "max_tokens": 96,
        "use_beam_search": True, "structured_outputs": {"disable_any_whitespace": True}})
    assert r.status_code == 200, r.text
    choices = r.json()["choices"]
    assert len(choices) == 2 and choices[0]["message"] != choices[1]["message"]
    for c in choices:
        assert c["finish_reason"] == "tool_calls" and c["message"]["content"] is None, c
        (call,) = c["message"]["tool_calls"]
        assert call["function"]["name"] == "get_time"
        jsonschema.validate(json.loads(call["function"]["arguments"]), schema)


def test_a_client_that_leaves_frees_the_search(server, model):
    """A client that disconnects mid-search aborts it in the core: its beams' blocks come back,
    long before the search could have run its 250 steps of 8 beams (2,000 tokens)."""
    body = {"model": "tiny", "prompt": prompt_ids(model[0])[2], "n": 8, "max_tokens": 250, "ignore_eos": True,
            "use_beam_search": True}
    ran = server.metrics().get("vllm:iteration_tokens_total_sum", 0)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.base_url + CMPL, json=body, timeout=httpx.Timeout(120, read=0.05))
    deadline = time.monotonic() + 60
    while True:
        m = server.metrics()
        if m.get("vllm:num_requests_running") == 0 and m.get("vllm:kv_cache_usage_perc") == 0:
            break
        assert time.monotonic() < deadline, m
        time.sleep(0.05)
    assert 0 < m["vllm:iteration_tokens_total_sum"] - ran < 1000
