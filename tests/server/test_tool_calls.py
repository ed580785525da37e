"""Tool calling through the server on the demo model (a Hermes-style tool template, hermes and
qwen3 parsers on): the prompt is the chat template's rendering with the tools, the history may
hold tool calls and tool results, and forced calls (required, a named function) always carry
arguments that validate against the function's parameter schema."""
from __future__ import annotations

import json

import jsonschema
import pytest

CHAT = "/v1/chat/completions"
WEATHER = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 20},
    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
    "days": {"type": "integer", "minimum": 1, "maximum": 7}},
    "required": ["city", "unit", "days"], "additionalProperties": False}
TIME = {"type": "object", "properties": {"timezone": {"type": "string", "pattern": "^[A-Z][a-z]{2,8}/[A-Z][a-z]{2,8}$"}},
        "required": ["timezone"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather forecast",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": TIME}}]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
MSG = [{"role": "user", "content": "Continue: What is the weather in Paris"}]
HISTORY = [
    *MSG,
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius", "days": 1}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "21 degrees and sunny"},
]


def test_tools_are_rendered_by_the_chat_template(tools_http, tools_model_dir):
    """prompt_tokens is the length of HF's own rendering of the same messages and tools."""
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(tools_model_dir)
    for messages in (MSG, HISTORY):
        r = tools_http.post(CHAT, json={"messages": messages, "tools": TOOLS, "tool_choice": "none",
                                        "max_tokens": 1})
        assert r.status_code == 200, r.text
        text = tok.apply_chat_template(messages_for_hf(messages), tools=TOOLS, tokenize=False,
                                       add_generation_prompt=True)
        assert "get_weather" in text and "Weather forecast" in text
        assert r.json()["usage"]["prompt_tokens"] == len(tok(text, add_special_tokens=False).input_ids)


def messages_for_hf(messages):
    """What the server hands the template: tool-call arguments as objects (as vLLM does)."""
    out = []
    for m in messages:
        m = dict(m, content=m.get("content") or "")
        if m.get("tool_calls"):
            m["tool_calls"] = [dict(c, function=dict(c["function"], arguments=json.loads(
                c["function"]["arguments"]))) for c in m["tool_calls"]]
        out.append(m)
    return out


def test_tool_choice_none_answers_in_text(tools_http):
    r = tools_http.post(CHAT, json={"messages": MSG, "tools": TOOLS, "tool_choice": "none",
                                    "max_tokens": 8, "temperature": 0})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["message"]["tool_calls"] is None and choice["message"]["content"]
    assert choice["finish_reason"] in ("stop", "length")


COMPACT = {"structured_outputs": {"disable_any_whitespace": True}}  # the demo model loves newlines


def _validate_calls(message, finish_reason):
    assert message.content is None
    assert message.tool_calls, message
    for call in message.tool_calls:
        assert call.id.startswith("call_") and call.type == "function"
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    assert finish_reason == "tool_calls"


def _streamed_calls(client, **kw):
    """Accumulate OpenAI tool-call deltas the way clients do: by index, the first delta naming."""
    calls, finish = {}, None
    for chunk in client.chat.completions.create(stream=True, **kw):
        for c in chunk.choices:
            finish = c.finish_reason or finish
            assert not c.delta.content
            for tc in c.delta.tool_calls or []:
                if tc.index not in calls:
                    assert tc.id.startswith("call_") and tc.type == "function" and tc.function.name
                    calls[tc.index] = [tc.function.name, tc.function.arguments or ""]
                else:
                    assert tc.id is None and tc.function.name is None
                    calls[tc.index][1] += tc.function.arguments or ""
    return [tuple(calls[i]) for i in sorted(calls)], finish


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_time"}},
                                         {"type": "function", "function": {"name": "get_weather"}}],
                         ids=["required", "named-get_time", "named-get_weather"])
def test_forced_tool_calls_validate(tools_client, tool_choice):
    kw = dict(model="tiny", messages=MSG, tools=TOOLS, tool_choice=tool_choice, max_tokens=96,
              temperature=1.0, parallel_tool_calls=False, extra_body=COMPACT)
    for seed in (7,):
        r = tools_client.chat.completions.create(seed=seed, **kw)
        choice = r.choices[0]
        _validate_calls(choice.message, choice.finish_reason)
        if isinstance(tool_choice, dict):
            assert [c.function.name for c in choice.message.tool_calls] == [tool_choice["function"]["name"]]
        calls, finish = _streamed_calls(tools_client, seed=seed, **kw)
        assert calls == [(c.function.name, c.function.arguments) for c in choice.message.tool_calls]
        assert finish == choice.finish_reason


HERMES_CALL = (r'Let me look\.\n<tool_call>\n\{"name": "get_time", "arguments": '
               r'\{"timezone": "[A-Z][a-z]{2,8}/[A-Z][a-z]{2,8}"\}\}\n</tool_call>')


def test_auto_tool_choice_parses_the_model_text(tools_client):
    """tool_choice=auto: the hermes parser reads a call the model wrote (here the model is made
    to write one with a regex, as no demo model calls tools on its own)."""
    kw = dict(model="tiny", messages=MSG, tools=TOOLS, tool_choice="auto", max_tokens=96,
              temperature=1.0, seed=3, extra_body={"guided_regex": HERMES_CALL})
    choice = tools_client.chat.completions.create(**kw).choices[0]
    assert choice.message.content == "Let me look.\n"
    assert [c.function.name for c in choice.message.tool_calls] == ["get_time"]
    jsonschema.validate(json.loads(choice.message.tool_calls[0].function.arguments), TIME)
    assert choice.finish_reason == "tool_calls"
    content, calls, finish = "", {}, None
    for chunk in tools_client.chat.completions.create(stream=True, **kw):
        for c in chunk.choices:
            content += c.delta.content or ""
            finish = c.finish_reason or finish
            for tc in c.delta.tool_calls or []:
                calls.setdefault(tc.index, [tc.function.name, ""])[1] += tc.function.arguments or ""
    assert content == choice.message.content and finish == "tool_calls"
    assert [tuple(v) for v in calls.values()] == [(c.function.name, c.function.arguments)
                                                  for c in choice.message.tool_calls]


def test_strict_functions_under_auto_compile_to_a_grammar():
    """strict tools under auto become xgrammar's structural tag of the hermes format, which the
    engine's grammar check accepts; the tag constrains get_weather's arguments to WEATHER."""
    from pagedserve.engine.structured.compiler import parse_spec
    from pagedserve.entrypoints.openai.protocol import ChatCompletionRequest
    from pagedserve.entrypoints.openai.structured_outputs import structured_outputs_of
    from pagedserve.entrypoints.openai.tool_parsers import TOOL_PARSERS
    from pagedserve.entrypoints.openai.tools import plan_tools
    tools = [dict(TOOLS[0], function=dict(TOOLS[0]["function"], strict=True)), TOOLS[1]]
    req = ChatCompletionRequest.model_validate({"messages": MSG, "tools": tools})
    params, param = structured_outputs_of(req, plan_tools(req, TOOL_PARSERS["hermes"]).constraint)
    assert param == "tools"
    tags = params.structural_tag["format"]["tags"]
    assert tags[0]["begin"].startswith("<tool_call>") and tags[0]["content"]["json_schema"] == WEATHER
    parse_spec(params)


def test_a_returned_tool_call_goes_back_into_the_history(tools_client):
    """The usual agent loop: the assistant message the client got back (as the openai client
    serializes it, nulls and all), then the tool's result, then the next turn."""
    kw = dict(model="tiny", tools=TOOLS, max_tokens=96, temperature=1.0, seed=5,
              extra_body=COMPACT)
    first = tools_client.chat.completions.create(
        messages=MSG, tool_choice={"type": "function", "function": {"name": "get_time"}}, **kw)
    message = first.choices[0].message
    call = message.tool_calls[0]
    history = [*MSG, message.model_dump(), {"role": "tool", "tool_call_id": call.id,
                                            "content": "It is noon."}]
    second = tools_client.chat.completions.create(messages=history, tool_choice="none", **kw)
    assert second.choices[0].message.content
    assert second.usage.prompt_tokens > first.usage.prompt_tokens + first.usage.completion_tokens


def test_plain_chat_through_the_parsers_streams_the_same_text(tools_http):
    """With --reasoning-parser on, every chat answer goes through the message parser: a text
    without <think> is all content, streamed or not."""
    body = {"messages": MSG, "max_tokens": 24, "temperature": 1.0, "seed": 9}
    whole = tools_http.post(CHAT, json=body).json()["choices"][0]
    text, finish = "", None
    with tools_http.stream("POST", CHAT, json={**body, "stream": True}) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                for c in json.loads(line[6:])["choices"]:
                    assert "reasoning_content" not in c["delta"] and "tool_calls" not in c["delta"]
                    text += c["delta"].get("content") or ""
                    finish = c["finish_reason"] or finish
    assert whole["message"]["content"] and whole["message"]["reasoning_content"] is None
    assert (text, finish) == (whole["message"]["content"], whole["finish_reason"])


def test_forced_calls_with_n_choices(tools_client):
    """Each of n sampled choices carries its own schema-valid call (grammar state per sequence)."""
    r = tools_client.chat.completions.create(
        model="tiny", messages=MSG, tools=TOOLS, tool_choice="required", parallel_tool_calls=False,
        n=3, temperature=1.0, seed=13, max_tokens=96, extra_body=COMPACT)
    assert len(r.choices) == 3
    for choice in r.choices:
        _validate_calls(choice.message, choice.finish_reason)
    assert len({c.message.tool_calls[0].function.arguments for c in r.choices}) > 1  # really sampled


def test_required_cut_before_a_function_name_is_no_call_and_no_text(tools_http):
    """tool_choice=required cut by max_tokens before the first function name is complete: no
    tool call, no content (the grammar's partial JSON is not the model's prose) and
    finish_reason "length", streamed or not. vLLM 0.26 answers the same: its required parse
    drops a list that fails to validate and clears the content (content "" and tool_calls [] in
    its encoding, null here as for every forced call), and relabels only a "stop" as
    "tool_calls"; neither the raw text nor an error."""
    prefix = tools_http.post("/tokenize", json={"prompt": '[{"name":"get_time"',
                                                "add_special_tokens": False}).json()["count"]
    assert prefix > 2  # (so two tokens cannot hold a whole name)
    body = {"messages": MSG, "tools": TOOLS, "tool_choice": "required", "max_tokens": 2,
            "temperature": 0, **COMPACT}
    r = tools_http.post(CHAT, json=body)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert r.json()["usage"]["completion_tokens"] == 2
    assert choice["finish_reason"] == "length", choice
    assert choice["message"]["content"] is None and choice["message"]["tool_calls"] is None, choice
    with tools_http.stream("POST", CHAT, json={**body, "stream": True}) as s:
        chunks = [json.loads(line[6:]) for line in s.iter_lines()
                  if line.startswith("data: {")]
    deltas = [c["choices"][0] for c in chunks if c["choices"]]
    assert not any(d["delta"].get("content") or d["delta"].get("tool_calls") for d in deltas), deltas
    assert deltas[-1]["finish_reason"] == "length"
