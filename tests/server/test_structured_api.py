"""Structured outputs through the server, on the demo model (it knows no JSON: a valid document
is the grammar's work): OpenAI's response_format, vLLM's structured_outputs and guided_* fields,
completions and chat, streamed and not, with sampling on. Every finished output validates
(jsonschema / re.fullmatch / the choice list), and a stream concatenates to the non-streamed
text of the same seed."""
from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import pytest

CMPL = "/v1/completions"
CHAT = "/v1/chat/completions"
MSG = [{"role": "user", "content": "Continue: And God said"}]
COMPACT = {"structured_outputs": {"disable_any_whitespace": True}}  # the demo model loves newlines

SCHEMAS = {
    "nested": {"type": "object", "required": ["person", "active"], "additionalProperties": False,
               "properties": {"person": {"type": "object", "required": ["name", "age"],
                                         "additionalProperties": False,
                                         "properties": {"name": {"type": "string", "maxLength": 12},
                                                        "age": {"type": "integer", "minimum": 0,
                                                                "maximum": 120}}},
                              "active": {"type": "boolean"}}},
    "bounded-array-enum": {"type": "object", "required": ["tags"], "additionalProperties": False,
                           "properties": {"tags": {"type": "array", "minItems": 1, "maxItems": 3,
                                                   "items": {"enum": ["law", "psalm", "prophet"]}}}},
    "anyof-nullable": {"type": "object", "required": ["id", "note"], "additionalProperties": False,
                       "properties": {"id": {"anyOf": [{"type": "integer", "minimum": 1, "maximum": 99},
                                                       {"type": "string", "pattern": "^[A-Z]{2}$"}]},
                                      "note": {"type": ["string", "null"], "maxLength": 10}}},
    "pattern-number-format": {"type": "object", "required": ["verse", "score", "day"],
                              "additionalProperties": False,
                              "properties": {"verse": {"type": "string", "pattern": "^[A-Z][a-z]{2,6} [0-9]{1,2}:[0-9]{1,2}$"},
                                             "score": {"type": "number", "minimum": -1.5, "maximum": 2.5},
                                             "day": {"type": "string", "format": "date"}}},
}


def _post_all(http, jobs):
    with ThreadPoolExecutor(len(jobs)) as pool:  # concurrent: the engine batches them
        return list(pool.map(lambda job: _post(http, *job), jobs))


def _post(http, path, body):
    if not body.get("stream"):
        r = http.post(path, json=body)
        assert r.status_code == 200, r.text
        c = r.json()["choices"][0]
        return (c["text"] if path == CMPL else c["message"]["content"]), c["finish_reason"]
    text, finish = "", None
    with http.stream("POST", path, json=body) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            for c in json.loads(line[6:])["choices"]:
                text += c["text"] if path == CMPL else c["delta"].get("content") or ""
                finish = c["finish_reason"] or finish
    return text, finish


def _jobs(constraint: dict, seeds=(0, 1), max_tokens=64):
    """The same constraint on completions and chat, each seed non-streamed and streamed."""
    jobs = []
    for path, base in ((CMPL, {"prompt": "And God said"}), (CHAT, {"messages": MSG})):
        for seed in seeds:
            for stream in (False, True):
                jobs.append((path, {**base, **constraint, "temperature": 1.0, "seed": seed,
                                    "max_tokens": max_tokens, "stream": stream}))
    return jobs


def _check(results, valid):
    """Pairs (non-streamed, streamed) of one seed agree; finished outputs are valid; most finish."""
    for (text, finish), (s_text, s_finish) in zip(results[::2], results[1::2]):
        assert (s_text, s_finish) == (text, finish)
        if finish == "stop":
            valid(text)
    assert sum(f == "stop" for _, f in results) >= len(results) // 2, results


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_response_format_json_schema(tools_http, name):
    schema = SCHEMAS[name]
    fmt = {"response_format": {"type": "json_schema", "json_schema": {"name": name, "schema": schema,
                                                                      "strict": True}}, **COMPACT}
    checker = jsonschema.Draft202012Validator(schema, format_checker=jsonschema.FormatChecker())
    _check(_post_all(tools_http, _jobs(fmt)), lambda t: checker.validate(json.loads(t)))


def test_json_object_and_guided_json(tools_http):
    schema = SCHEMAS["nested"]
    results = _post_all(tools_http, _jobs({"response_format": {"type": "json_object"}, **COMPACT}, seeds=(3,))
                        + _jobs({"guided_json": schema, **COMPACT}, seeds=(4,)))
    _check(results[:4], lambda t: isinstance(json.loads(t), dict) or pytest.fail(t))
    _check(results[4:], lambda t: jsonschema.validate(json.loads(t), schema))


REGEX = r"(Genesis|Exodus) [1-9][0-9]?:[1-9][0-9]?"
CHOICES = ["light", "darkness", "the waters"]
GRAMMAR = 'root ::= "The " noun " is " adj "."\nnoun ::= "LORD" | "earth" | "firmament"\nadj ::= "good" | "void"'


@pytest.mark.parametrize("constraint,valid", [
    ({"guided_regex": REGEX}, lambda t: re.fullmatch(REGEX, t) or pytest.fail(t)),
    ({"structured_outputs": {"regex": REGEX}}, lambda t: re.fullmatch(REGEX, t) or pytest.fail(t)),
    ({"guided_choice": CHOICES}, lambda t: t in CHOICES or pytest.fail(t)),
    ({"structured_outputs": {"choice": CHOICES}}, lambda t: t in CHOICES or pytest.fail(t)),
    ({"guided_grammar": GRAMMAR},
     lambda t: re.fullmatch(r"The (LORD|earth|firmament) is (good|void)\.", t) or pytest.fail(t)),
], ids=["guided_regex", "structured_regex", "guided_choice", "structured_choice", "guided_grammar"])
def test_regex_choice_grammar(tools_http, constraint, valid):
    results = _post_all(tools_http, _jobs(constraint, seeds=(5,), max_tokens=24))
    assert all(f == "stop" for _, f in results), results  # short languages: always finished
    _check(results, valid)


def test_openai_client_parse_with_a_pydantic_model(tools_client):
    from pydantic import BaseModel, Field

    class Verse(BaseModel):
        book: str = Field(max_length=10)
        chapter: int = Field(ge=1, le=50)
        holy: bool

    completion = tools_client.chat.completions.parse(
        model="tiny", messages=MSG, response_format=Verse, max_tokens=64, temperature=0.8,
        seed=11, extra_body=COMPACT)
    choice = completion.choices[0]
    assert choice.finish_reason == "stop", choice
    assert isinstance(choice.message.parsed, Verse)
    assert Verse.model_validate_json(choice.message.content) == choice.message.parsed


def test_a_grammar_left_no_token_to_draw_is_a_400(tools_http):
    """allowed_token_ids that hold none of the tokens the grammar accepts (or a grammar with a dead
    end, or one that matches no text) leave the draw nothing: the grammar refuses the token drawn
    anyway. That ended as an empty "abort" under a 200; now a 400 saying why (streamed: an error
    event), and the server goes on serving."""
    q = tools_http.post("/tokenize", json={"prompt": "q", "add_special_tokens": False}).json()["tokens"]
    cases = [  # (body, the field the error names: the one that set the grammar)
        ({"prompt": "And", "allowed_token_ids": q, "structured_outputs": {"choice": ["yes", "no"]}},
         "structured_outputs.choice"),
        ({"prompt": "And", "temperature": 0, "structured_outputs": {"grammar": 'root ::= "a" x\nx ::= x'}},
         "structured_outputs.grammar"),
        ({"prompt": "And", "structured_outputs": {"grammar": "root ::= root"}},  # matches no text
         "structured_outputs.grammar"),
        ({"prompt": "And", "guided_regex": "[^\\x00-\\U0010FFFF]"}, "guided_regex"),
        # chat: the field is response_format's schema; q alone cannot open a JSON object
        ({"messages": MSG, "allowed_token_ids": q, "response_format": {
            "type": "json_schema", "json_schema": {"name": "n", "schema": {"type": "object"}}}},
         "response_format.json_schema.schema"),
        # a forced tool call: its grammar comes from tool_choice
        ({"messages": MSG, "allowed_token_ids": q, "tool_choice": "required", "tools": [
            {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]},
         "tool_choice"),
    ]
    for body, param in cases:
        path = CHAT if "messages" in body else CMPL
        r = tools_http.post(path, json={"max_tokens": 8, **body})
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["code"] == "structured_outputs_failed" and "accepts no token" in err["message"], err
        assert err["param"] == param, err
        with tools_http.stream("POST", path, json={"max_tokens": 8, "stream": True, **body}) as s:
            events = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: {")]
        assert events[-1]["error"]["code"] == "structured_outputs_failed", events
        assert events[-1]["error"]["param"] == param, events
    # Tokens both allow: served (one token: the end of "q" is EOS, which allowed_token_ids leaves out)
    r = tools_http.post(CMPL, json={"prompt": "And", "max_tokens": len(q), "allowed_token_ids": q,
                                    "structured_outputs": {"choice": ["q", "qq"]}})
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == "q", r.text


@pytest.fixture(scope="module")
def impatient_server(tools_model_dir, tmp_path_factory):
    """A server whose grammars can never compile in time (a 1 microsecond limit)."""
    from server_process import start_server, stop_server
    s = start_server(tools_model_dir, tmp_path_factory.mktemp("impatient") / "server.log",
                     "--max-model-len", "256", "--num-gpu-blocks-override", "64",
                     "--max-num-seqs", "8", "--swap-space", "0.05",
                     "--structured-outputs-compile-timeout-s", "0.000001")
    yield s
    stop_server(s)


def test_a_grammar_that_compiles_too_slowly_fails_alone(impatient_server):
    """The engine ends that request alone; the server answers a 400 saying why (streamed: an
    error event) and keeps serving the others."""
    import httpx
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    with httpx.Client(base_url=impatient_server.base_url, timeout=120) as http:
        r = http.post(CHAT, json={"messages": MSG, "max_tokens": 8, "guided_json": schema})
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["code"] == "structured_outputs_failed" and "compile" in err["message"]
        assert err["param"] == "guided_json", err  # the field whose grammar failed
        with http.stream("POST", CMPL, json={"prompt": "And", "max_tokens": 8, "stream": True,
                                             "guided_regex": "[a-z]+"}) as s:
            events = [json.loads(line[6:]) for line in s.iter_lines()
                      if line.startswith("data: {")]
        assert events[-1]["error"]["code"] == "structured_outputs_failed"
        assert events[-1]["error"]["param"] == "guided_regex", events
        r = http.post(CHAT, json={"messages": MSG, "max_tokens": 4})
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"]
