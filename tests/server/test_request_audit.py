"""No silent drops: every field of OpenAI's completions and chat APIs is either honoured or a 400
naming it; keys outside the API are ignored with one log line; bad output constraints and bad
tools are 400s that name the field and the problem."""
from __future__ import annotations

import typing

import pytest

from pagedserve.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest

CMPL = "/v1/completions"
CHAT = "/v1/chat/completions"
MSG = [{"role": "user", "content": "hi"}]
TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


def c(**kw):
    return {"prompt": "hello", "max_tokens": 2, **kw}


def ch(**kw):
    return {"messages": MSG, "max_tokens": 2, **kw}


def _openai_fields(module) -> set[str]:
    return set(typing.get_type_hints(module.CompletionCreateParamsBase, include_extras=False)) | {"stream"}


def test_every_openai_field_is_declared():
    """Each field the openai client can send is a field of our model (honoured, or in the
    model's UNSUPPORTED audit): none falls through as an ignored unknown key."""
    from openai.types import completion_create_params
    from openai.types.chat import completion_create_params as chat_params
    assert _openai_fields(completion_create_params) <= set(CompletionRequest.model_fields)
    assert _openai_fields(chat_params) <= set(ChatCompletionRequest.model_fields)


# A value pagedserve cannot honour for each audited field.
UNHONOURED = {
    "audio": {"voice": "alloy", "format": "wav"}, "modalities": ["text", "audio"],
    "prediction": {"type": "content", "content": "x"}, "web_search_options": {},
    "store": True, "metadata": {"k": "v"}, "service_tier": "flex", "reasoning_effort": "low",
    "functions": [{"name": "f"}], "function_call": "auto", "moderation": {"model": "m"},
    "verbosity": "low", "prompt_cache_retention": "24h", "prompt_cache_options": {"x": 1},
    # vLLM's extras (use_beam_search and length_penalty are honoured: test_beam_search_api.py)
    "logits_processors": ["x"],
    "vllm_xargs": {"a": 1}, "kv_transfer_params": {"a": 1}, "ec_transfer_params": {"a": 1},
    "logprob_token_ids": [3, 4],
    "thinking_token_budget": 64, "return_token_offsets": True,
    "chat_template": "{{ messages }}", "documents": [{"text": "x"}],
    "media_io_kwargs": {"image": {}}, "mm_processor_kwargs": {"fps": 1},
    "return_assistant_tokens_mask": True,
}


def test_unhonoured_values_cover_the_audit():
    assert set(UNHONOURED) == set(ChatCompletionRequest.UNSUPPORTED)


@pytest.mark.parametrize("field", sorted(UNHONOURED))
def test_unhonoured_chat_field_is_a_400_naming_it(tools_http, field):
    r = tools_http.post(CHAT, json=ch(**{field: UNHONOURED[field]}))
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == field
    assert field in r.json()["error"]["message"]


@pytest.mark.parametrize("field", sorted(CompletionRequest.UNSUPPORTED))
def test_unhonoured_completion_field_is_a_400_naming_it(tools_http, field):
    r = tools_http.post(CMPL, json=c(**{field: {**UNHONOURED, "suffix": "tail", "prompt_embeds": "AAAA"}[field]}))
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == field


def test_no_op_values_are_accepted(tools_http):
    r = tools_http.post(CHAT, json=ch(store=False, metadata={}, service_tier="auto", modalities=["text"],
                                      logit_bias={}, audio=None, functions=None, user="u1",
                                      prompt_cache_key="k", safety_identifier="s",
                                      response_format={"type": "text"}, tool_choice="none",
                                      parallel_tool_calls=True))
    assert r.status_code == 200, r.text
    r = tools_http.post(CMPL, json=c(suffix="", logit_bias={}, use_beam_search=False, priority=0,
                                     spaces_between_special_tokens=True))
    assert r.status_code == 200, r.text


def test_continue_final_message(tools_http):
    """vLLM's continue_final_message: the prompt ends inside the last (assistant) message."""
    messages = [*MSG, {"role": "assistant", "content": "And the LORD"}]
    r = tools_http.post(CHAT, json=ch(messages=messages, continue_final_message=True,
                                      add_generation_prompt=False))
    assert r.status_code == 200, r.text
    r2 = tools_http.post(CHAT, json=ch(messages=messages))
    # The closed turn adds its end-of-turn token and the next assistant header.
    assert r.json()["usage"]["prompt_tokens"] < r2.json()["usage"]["prompt_tokens"]
    r = tools_http.post(CHAT, json=ch(messages=messages, continue_final_message=True))
    assert r.status_code == 400 and r.json()["error"]["param"] == "continue_final_message"


def test_unknown_keys_are_ignored_with_a_log_line(tools_http, tools_server):
    r = tools_http.post(CHAT, json=ch(frobnicate_level=3))
    assert r.status_code == 200, r.text
    assert "present in the request but ignored: 'frobnicate_level'" in tools_server.log()
    # A key is the client's text: it is quoted, so a newline in it cannot forge a log line.
    r = tools_http.post(CHAT, json=ch(**{"x\nINFO 12-01 00:00:00 api-server: forged": 1}))
    assert r.status_code == 200, r.text
    assert "\nINFO 12-01 00:00:00 api-server: forged" not in tools_server.log()
    assert "'x\\nINFO 12-01 00:00:00 api-server: forged'" in tools_server.log()


BAD_SCHEMA = {"type": "object", "properties": {"n": {"type": "integer", "minimum": "zero"}}}


def _deep_schema(levels: int) -> dict:
    """anyOf nested `levels` deep: jsonschema's meta-schema check ran out of recursion (a 500)."""
    s = {"type": "string"}
    for _ in range(levels):
        s = {"anyOf": [s, {"type": "null"}]}
    return s


JS = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}}

# (id, path, body, param, a word the message must hold)
CASES = [
    ("format-unknown-type", CHAT, ch(response_format={"type": "xml"}), "response_format.type", "json_schema"),
    ("format-no-schema", CHAT, ch(response_format={"type": "json_schema", "json_schema": {"name": "x"}}),
     "response_format.json_schema", "schema"),
    ("format-description", CHAT, ch(response_format={"type": "json_schema", "json_schema": {
        "name": "x", "description": "a verse", "schema": {"type": "object"}}}),
     "response_format.json_schema.description", "message"),
    ("format-invalid-schema", CHAT, ch(response_format={"type": "json_schema", "json_schema": {
        "name": "x", "schema": BAD_SCHEMA}}), "response_format.json_schema.schema", "minimum"),
    ("format-completions", CMPL, c(response_format={"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "objectx"}}}), "response_format.json_schema.schema", "objectx"),
    ("guided-json-not-json", CMPL, c(guided_json="{not json"), "guided_json", "not JSON"),
    ("guided-json-invalid", CHAT, ch(guided_json=BAD_SCHEMA), "guided_json", "minimum"),
    ("guided-regex", CMPL, c(guided_regex="a(b"), "guided_regex", "parenthesis"),
    ("guided-grammar", CHAT, ch(guided_grammar="root ::= foo"), "guided_grammar", "foo"),
    ("guided-choice-empty", CMPL, c(guided_choice=[]), "guided_choice", "choice"),
    ("structured-two-kinds", CMPL, c(structured_outputs={"regex": "a+", "choice": ["a"]}),
     "structured_outputs", "exactly one"),
    ("structured-invalid-json", CMPL, c(structured_outputs={"json": BAD_SCHEMA}),
     "structured_outputs.json", "minimum"),
    ("two-constraints", CHAT, ch(response_format=JS, guided_regex="a+"), "guided_regex", "both"),
    ("backend", CMPL, c(guided_json={"type": "object"}, guided_decoding_backend="outlines"),
     "guided_decoding_backend", "xgrammar"),
    ("obfuscation", CHAT, ch(stream=True, stream_options={"include_obfuscation": True}),
     "stream_options.include_obfuscation", "obfuscation"),
    ("tool-choice-without-tools", CHAT, ch(tool_choice="required"), "tool_choice", "tools"),
    ("tool-choice-unknown-function", CHAT, ch(tools=[TOOL], tool_choice={
        "type": "function", "function": {"name": "nope"}}), "tool_choice", "nope"),
    ("tool-invalid-parameters", CHAT, ch(tools=[{"type": "function", "function": {
        "name": "f", "parameters": BAD_SCHEMA}}], tool_choice="required"),
     "tools.0.function.parameters", "minimum"),
    ("tool-bad-name", CHAT, ch(tools=[{"type": "function", "function": {"name": "a b"}}]),
     "tools.0.function.name", "pattern"),
    ("tool-duplicate", CHAT, ch(tools=[TOOL, TOOL]), "tools", "get_weather"),
    ("tool-type", CHAT, ch(tools=[{"type": "custom", "custom": {"name": "f"}}]), "tools.0.type", "function"),
    ("tool-and-format", CHAT, ch(tools=[TOOL], tool_choice="required", response_format=JS),
     "tool_choice", "both"),
    ("tool-message-without-id", CHAT, ch(messages=[*MSG, {"role": "tool", "content": "20C"}]),
     "messages.1.tool_call_id", "tool_call_id"),
    ("tool-calls-on-user", CHAT, ch(messages=[{"role": "user", "content": "x", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]),
     "messages.0.tool_calls", "assistant"),
    ("history-function-call", CHAT, ch(messages=[*MSG, {"role": "assistant", "content": None,
                                                        "function_call": {"name": "f", "arguments": "{}"}}]),
     "messages.1.function_call", "tool_calls"),
    ("template-kwargs-clash", CHAT, ch(chat_template_kwargs={"tokenize": True}),
     "chat_template_kwargs", "tokenize"),
    ("schema-too-deep", CMPL, c(guided_json=_deep_schema(100)), "guided_json", "at most 64"),
    ("schema-text-too-deep", CMPL, c(guided_json="[" * 3000 + "]" * 3000), "guided_json", "not JSON"),
    ("tool-parameters-too-deep", CHAT, ch(tools=[{"type": "function", "function": {
        "name": "f", "parameters": _deep_schema(100)}}], tool_choice="none"), "tools.0.function.parameters",
     "at most 64"),
    # keywords the grammar would not enforce (engine/structured/compiler.unenforced_keyword)
    ("schema-keyword-not-enforced", CHAT, ch(response_format={"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "properties": {"n": {"not": {"type": "integer"}}}}}}),
     "response_format.json_schema.schema", "`not` at $.properties.n"),
    ("guided-json-remote-ref", CMPL, c(guided_json={"$ref": "http://10.0.0.1/x.json"}), "guided_json",
     "http://10.0.0.1/x.json"),
    ("tool-forced-loose-parameters", CHAT, ch(tools=[{"type": "function", "function": {
        "name": "f", "parameters": {"type": "object", "properties": {"a": {"type": "number", "multipleOf": 0.5}}}}}],
        tool_choice="required"), "tools.0.function.parameters", "`multipleOf`"),
    ("tool-strict-loose-parameters", CHAT, ch(tools=[TOOL, {"type": "function", "function": {
        "name": "f", "strict": True, "parameters": {"type": "object", "properties": {"a": {
            "allOf": [{"type": "integer"}, {"minimum": 1}]}}}}}]), "tools.1.function.parameters", "`allOf`"),
]


@pytest.mark.parametrize("name,path,body,param,word", CASES, ids=[x[0] for x in CASES])
def test_bad_constraint_or_tool_is_a_400(tools_http, name, path, body, param, word):
    r = tools_http.post(path, json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error"
    assert err["param"] == param, err
    assert word in err["message"], err


def test_a_tool_schema_only_shown_to_the_model_may_use_any_keyword(tools_http):
    """Under tool_choice auto (no strict) or none, parameters are rendered, not enforced: a keyword
    the grammar could not enforce is no reason to refuse them."""
    loose = {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"not": {"type": "integer"}}}}}}
    for choice in ("auto", "none"):
        r = tools_http.post(CHAT, json=ch(tools=[loose], tool_choice=choice))
        assert r.status_code == 200, r.text


def test_auto_tool_choice_needs_the_flags(http):
    """The shared server runs without --enable-auto-tool-choice: auto (also the default with
    tools) is a 400, as in vLLM; none and a forced call still work there."""
    for body in (ch(model="tiny", tools=[TOOL]), ch(model="tiny", tools=[TOOL], tool_choice="auto")):
        r = http.post(CHAT, json=body)
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == "tool_choice"
        assert "--enable-auto-tool-choice" in r.json()["error"]["message"]
    r = http.post(CHAT, json=ch(model="tiny", tools=[TOOL], tool_choice="none"))
    assert r.status_code == 200, r.text


def test_validating_requests_leaves_no_cyclic_garbage():
    """A request's model is freed by reference counting alone, unknown keys remembered or not.
    (Under pydantic 2.13 a private attribute with a builtin default_factory left ~26 objects of
    cyclic garbage per request, from inspect.signature on the factory: 33,488 of them made one
    young collection stall the H200 server's event loop for 174 ms.) In a process of its own, so
    that no other test's threads or garbage are counted."""
    import json
    import subprocess
    import sys
    code = """
import gc, json
from pagedserve.entrypoints.openai.protocol import ChatCompletionRequest as Chat, CompletionRequest as Cmpl
msg = [{"role": "user", "content": "hi"}]
bodies = [(Cmpl, {"prompt": "hello", "max_tokens": 2}), (Cmpl, {"prompt": "hello", "not_openai": 1, "zz": 2}),
          (Chat, {"messages": msg}), (Chat, {"messages": msg, "extra_key": True})]
for cls, body in bodies:  # anything a first validation builds once is not the point
    cls.model_validate(body)
gc.collect()
gc.set_debug(gc.DEBUG_SAVEALL)
kept = [list(cls.model_validate(body)._unknown_keys) for cls, body in bodies for _ in range(20)]
gc.collect()
print(json.dumps({"kept": [kept[0], kept[20], kept[60]], "garbage": sorted({type(o).__name__ for o in gc.garbage}),
                  "count": len(gc.garbage)}))
"""
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    got = json.loads(run.stdout.strip().splitlines()[-1])
    assert got["kept"] == [[], ["not_openai", "zz"], ["extra_key"]]
    assert got["count"] == 0, got["garbage"]


def test_no_api_model_has_a_private_attribute_factory():
    """The property behind the test above, whatever pydantic is installed: no model of the API has
    a private attribute with a default_factory (pydantic 2.13 signs it per instance)."""
    from pydantic import BaseModel

    from pagedserve.entrypoints.openai import protocol
    models = [m for m in vars(protocol).values() if isinstance(m, type) and issubclass(m, BaseModel)
              and m is not BaseModel]
    assert CompletionRequest in models and ChatCompletionRequest in models
    assert "_unknown_keys" in CompletionRequest.__private_attributes__
    factories = {(m.__name__, name) for m in models for name, attr in m.__private_attributes__.items()
                 if attr.default_factory is not None}
    assert factories == set()
