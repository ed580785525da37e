"""Tool-call and reasoning parsers on fixed model texts: the whole-text result is what the model
meant, and the streamed deltas, however the text is chunked, concatenate to that result."""
from __future__ import annotations

import json
import random

import pytest

from pagedserve.entrypoints.openai.message_stream import MessageParser, MessageStreamer
from pagedserve.entrypoints.openai.reasoning_parsers import REASONING_PARSERS
from pagedserve.entrypoints.openai.tool_parsers import TOOL_PARSERS
from pagedserve.entrypoints.openai.tool_parsers.forced import (NamedFunctionParser,
                                                               RequiredToolsParser)

W = {"location": "Paris, France", "unit": "celsius"}
T = {"timezone": "Europe/Paris"}


def _args(d):
    return json.dumps(d)


# (parser, model text, expected content, expected [(name, arguments dict)])
TOOL_CASES = [
    ("hermes", 'The weather:\n<tool_call>\n{"name": "get_weather", "arguments": '
               f'{_args(W)}}}\n</tool_call>', "The weather:\n", [("get_weather", W)]),
    ("hermes", f'<tool_call>\n{{"name": "get_weather", "arguments": {_args(W)}}}\n</tool_call>\n'
               f'<tool_call>\n{{"name": "get_time", "arguments": {_args(T)}}}\n</tool_call>',
     "", [("get_weather", W), ("get_time", T)]),
    ("hermes", '<tool_call>{"arguments": {"q": "x \\"quoted\\" <tool_call>"}, "name": "search"}'
               '</tool_call>', "", [("search", {"q": 'x "quoted" <tool_call>'})]),
    ("hermes", "No tools needed: 1 < 2 and <tool is fine.", "No tools needed: 1 < 2 and <tool is fine.",
     []),
    ("hermes", "<tool_call>\n{not json}\n</tool_call>", "<tool_call>\n{not json}\n</tool_call>", []),
    ("hermes", '<tool_call>{"name": "f", "arguments": {"nested": {"a": [1, {"b": "}"}]}}}</tool_call>',
     "", [("f", {"nested": {"a": [1, {"b": "}"}]}})]),
    ("llama3_json", f'{{"name": "get_weather", "parameters": {_args(W)}}}', "", [("get_weather", W)]),
    ("llama3_json", f'<|python_tag|>{{"name": "get_weather", "parameters": {_args(W)}}}; '
                    f'{{"name": "get_time", "parameters": {_args(T)}}}',
     "", [("get_weather", W), ("get_time", T)]),
    ("llama3_json", "It is sunny in Paris.", "It is sunny in Paris.", []),
    ("llama3_json", '{"answer": 42}', '{"answer": 42}', []),
    ("mistral", f'[TOOL_CALLS] [{{"name": "get_weather", "arguments": {_args(W)}}}, '
                f'{{"name": "get_time", "arguments": {_args(T)}, "id": "abcdef123"}}]',
     "", [("get_weather", W), ("get_time", T)]),
    ("mistral", f'Let me check.[TOOL_CALLS]get_weather[ARGS]{_args(W)}[TOOL_CALLS]get_time[ARGS]'
                f'{_args(T)}', "Let me check.", [("get_weather", W), ("get_time", T)]),
    ("mistral", "Plain [TOOL answer.", "Plain [TOOL answer.", []),
    ("phi4_mini_json", f'functools[{{"name": "get_weather", "arguments": {_args(W)}}}, '
                       f'{{"name": "get_time", "arguments": {_args(T)}}}]', "", [("get_weather", W), ("get_time", T)]),
    ("phi4_mini_json", f'I will look it up. functools[{{"name": "get_weather", "parameters": {_args(W)}}}]',
     "I will look it up. ", [("get_weather", W)]),
    ("phi4_mini_json", "import functools; functools.reduce(f, xs)", "import functools; functools.reduce(f, xs)", []),
    ("phi4_mini_json", 'functools[oops, {"name": "f", "arguments": {"a": "]"}}]',
     'functools[oops, {"name": "f", "arguments": {"a": "]"}}]', []),
    ("phi4_mini_json", 'functools[{"name": "f", "arguments": {"a": "]"}}]', "", [("f", {"a": "]"})]),
    ("pythonic", '[get_weather(location="Paris, France", unit="celsius"), get_time(timezone=\'Europe/Paris\')]',
     "", [("get_weather", W), ("get_time", T)]),
    ("pythonic", '<|python_start|>[get_weather(location="Paris, France", unit="celsius")]<|python_end|>',
     "", [("get_weather", W)]),
    ("pythonic", ' [search(q="a (paren] \\"quoted\\"", limit=3, exact=True, tags=["x", None, (1, 2)]), now()]',
     "", [("search", {"q": 'a (paren] "quoted"', "limit": 3, "exact": True, "tags": ["x", None, [1, 2]]}),
          ("now", {})]),
    ("pythonic", "[Note] the list is empty.", "[Note] the list is empty.", []),
    ("pythonic", "It is sunny in Paris.", "It is sunny in Paris.", []),
    ("pythonic", "[f(1, a=2)]", "[f(1, a=2)]", []),  # positional arguments: not a call of this format
    ("pythonic", "[f(a=x)]", "[f(a=x)]", []),  # a name, not a literal
    ("pythonic", "[]", "[]", []),
]


def chunkings(text: str):
    """Many ways a stream can cut the text: every size up to 9, and random cuts."""
    for size in range(1, 10):
        yield [text[i:i + size] for i in range(0, len(text), size)]
    for seed in range(12):
        rng = random.Random(seed)
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 20))))
        yield [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]


def stream(parser: MessageParser, chunks: list[str]) -> dict:
    """Concatenate the deltas of a stream the way an OpenAI client does."""
    st = MessageStreamer(parser)
    content, reasoning, calls = "", "", {}
    for k, chunk in enumerate(chunks):
        d = st.feed(chunk, final=k == len(chunks) - 1)
        if d is None:
            continue
        content += d.content or ""
        reasoning += d.reasoning_content or ""
        for tc in d.tool_calls or []:
            if tc.index not in calls:
                assert tc.id.startswith("call_") and tc.type == "function" and tc.function.name
                assert tc.index == len(calls)  # calls open in order
                calls[tc.index] = {"name": tc.function.name, "arguments": ""}
            else:
                assert tc.id is None and tc.function.name is None  # only fragments follow
            calls[tc.index]["arguments"] += tc.function.arguments or ""
    return {"content": content, "reasoning": reasoning,
            "calls": [(c["name"], c["arguments"]) for _, c in sorted(calls.items())]}


def whole(parser: MessageParser, text: str) -> dict:
    m = parser.message(text)
    return {"content": m.content or "", "reasoning": m.reasoning_content or "",
            "calls": [(c.function.name, c.function.arguments) for c in m.tool_calls or []]}


@pytest.mark.parametrize("name,text,content,calls", TOOL_CASES,
                         ids=[f"{c[0]}-{i}" for i, c in enumerate(TOOL_CASES)])
def test_tool_parser_whole_and_streamed(name, text, content, calls):
    parser = MessageParser(tools=TOOL_PARSERS[name]())
    got = whole(parser, text)
    assert got["content"] == content
    assert [(n, json.loads(a)) for n, a in got["calls"]] == calls
    for chunks in chunkings(text):
        assert stream(parser, chunks) == got, chunks


@pytest.mark.parametrize("text", ["[f(a=1)] and then some text", "[f(a=1), g(b=", "[f(a={1, 2})]"])
def test_pythonic_whole_text_that_is_not_a_call_list_is_content(text):
    """Text after the list, a list cut off, a set (no JSON for it): content, as vLLM's parser."""
    assert whole(MessageParser(tools=TOOL_PARSERS["pythonic"]()), text) == {"content": text, "reasoning": "",
                                                                           "calls": []}


DEEP = "[" * 3000 + "]" * 3000  # nested past json's (and Python's parser's) recursion
DEEP_CASES = [("hermes", f'<tool_call>{{"name": "f", "arguments": {DEEP}}}</tool_call>'),
              ("hermes", f'<tool_call>{{"name": "f", "arguments": {DEEP[:3000]}'),
              ("llama3_json", f'{{"name": "f", "parameters": {DEEP}}}'),
              ("mistral", f'[TOOL_CALLS][{{"name": "f", "arguments": {DEEP}}}]'),
              ("pythonic", "[f(a=" + "-" * 3000 + "1)]")]


@pytest.mark.parametrize("name,text", DEEP_CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(DEEP_CASES)])
def test_output_nested_too_deep_to_parse_is_no_exception(name, text):
    """A grammar (or a model) can make the output nest thousands deep: the parsers' JSON decoder
    and ast.parse ran out of recursion, and the response failed. Now such text is no call."""
    parser = MessageParser(tools=TOOL_PARSERS[name]())
    got = whole(parser, text)
    assert got["calls"] == [] and got["content"] == text, got
    stream(parser, [text[:100], text[100:4000], text[4000:]])  # (what it sent of an open call stays sent)


def test_parallel_tool_calls_false_keeps_the_first():
    text = TOOL_CASES[1][1]
    parser = MessageParser(tools=TOOL_PARSERS["hermes"](), parallel_tool_calls=False)
    got = whole(parser, text)
    assert [n for n, _ in got["calls"]] == ["get_weather"]
    for chunks in chunkings(text):
        assert stream(parser, chunks) == got


REASONING_CASES = [
    ("qwen3", "<think>\nThe user wants 2+2.\n</think>\n\nIt is 4.", "\nThe user wants 2+2.\n",
     "\n\nIt is 4."),
    ("qwen3", "It is 4.", "", "It is 4."),
    ("qwen3", "<think>cut off while thinking", "cut off while thinking", ""),
    ("deepseek_r1", "2+2 is basic.</think>The answer is 4.", "2+2 is basic.", "The answer is 4."),
    ("deepseek_r1", "<think>hmm</think>4", "hmm", "4"),
    ("deepseek_r1", "still thinking <", "still thinking <", ""),
]


@pytest.mark.parametrize("name,text,reasoning,content", REASONING_CASES,
                         ids=[f"{c[0]}-{i}" for i, c in enumerate(REASONING_CASES)])
def test_reasoning_parser_whole_and_streamed(name, text, reasoning, content):
    parser = MessageParser(reasoning=REASONING_PARSERS[name]())
    got = whole(parser, text)
    assert (got["reasoning"], got["content"]) == (reasoning, content)
    for chunks in chunkings(text):
        assert stream(parser, chunks) == got, chunks


def test_reasoning_then_tool_calls():
    text = ('<think>I should look it up.</think>\n\n<tool_call>\n{"name": "get_weather", '
            f'"arguments": {_args(W)}}}\n</tool_call>')
    parser = MessageParser(reasoning=REASONING_PARSERS["qwen3"](), tools=TOOL_PARSERS["hermes"]())
    got = whole(parser, text)
    assert got["reasoning"] == "I should look it up."
    assert got["content"] == "\n\n"
    assert [(n, json.loads(a)) for n, a in got["calls"]] == [("get_weather", W)]
    for chunks in chunkings(text):
        assert stream(parser, chunks) == got


@pytest.mark.parametrize("text,calls", [
    (f'[{{"name": "get_weather", "parameters": {_args(W)}}}, {{"name": "get_time", '
     f'"parameters": {_args(T)}}}]', [("get_weather", W), ("get_time", T)]),
    ('[ {"name":"f","parameters":{}} ]', [("f", {})]),
])
def test_required_tools_output(text, calls):
    parser = MessageParser(tools=RequiredToolsParser())
    got = whole(parser, text)
    assert got["content"] == ""
    assert [(n, json.loads(a)) for n, a in got["calls"]] == calls
    for chunks in chunkings(text):
        assert stream(parser, chunks) == got


def test_named_function_output():
    text = _args(W)
    parser = MessageParser(tools=NamedFunctionParser("get_weather"))
    got = whole(parser, text)
    assert got == {"content": "", "reasoning": "", "calls": [("get_weather", text)]}
    for chunks in chunkings(text):
        assert stream(parser, chunks) == got


def test_flag_choices_are_the_registries():
    from pagedserve.config import REASONING_PARSERS as REASONING_NAMES
    from pagedserve.config import TOOL_CALL_PARSERS
    assert set(TOOL_CALL_PARSERS) == set(TOOL_PARSERS)
    assert set(REASONING_NAMES) == set(REASONING_PARSERS)


def test_auto_tool_choice_flag_needs_a_parser():
    from pagedserve.config import EngineConfig
    with pytest.raises(ValueError, match="tool_call_parser"):
        EngineConfig(enable_auto_tool_choice=True)
    with pytest.raises(ValueError, match="reasoning_parser"):
        EngineConfig(reasoning_parser="nope")
