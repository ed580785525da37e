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
TIME = {"type": "object", "properties": {"timezone": {"type": "string", "pattern": "^[A-Z][a-z]+/[A-Z][a-z]+$"}},
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
