"""What every tool-call parser shares: the parse result, tag hold-back, and a JSON call reader.

A parser is a pure function of the text generated so far, `parse(text, final)`. With
final=False the text may still grow, and the result must be *prefix-stable*: its content and
each call's arguments are prefixes of what any longer text gives, and calls only ever get
appended. That is what lets one function serve both the whole-text response and the stream:
the streamer (message_stream.py) sends the difference between consecutive results, so the
streamed deltas concatenate to the whole-text result by construction. Arguments are the raw
JSON slice the model wrote (not re-serialized), for the same reason. One exception: a call that
never completes (the text cut off inside it, or a call array turning invalid after complete
calls) has been streamed as it grew, while the whole text falls back to content, as vLLM's
whole-text parsers do; a stream cannot take back what it sent.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import ClassVar

_DECODER = json.JSONDecoder()
_WS = re.compile(r"\s*")
# {"name": "<name>", "arguments"|"parameters": <value>...}: the layout every parser here reads
# while a call is still open (a complete call may have its keys in any order).
_CALL_HEAD = re.compile(r'\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(?:arguments|parameters)"\s*:\s*')
ARGUMENT_KEYS = ("arguments", "parameters")


@dataclass
class CallText:
    name: str
    arguments: str  # JSON text; while the call is open, a prefix of it


@dataclass
class Parsed:
    content: str = ""
    calls: list[CallText] = field(default_factory=list)


class ToolParser:
    """Base of the named parsers (registered in tool_parsers/__init__.py)."""
    name: ClassVar[str] = ""
    # Whether the parser needs special tokens kept in the text (its markers are special tokens).
    keeps_special_tokens: ClassVar[bool] = False
    # xgrammar's built-in structural tag of this call format (get_builtin_structural_tag), which
    # enforces `strict` functions under tool_choice=auto; None: strict cannot be enforced.
    xgrammar_format: ClassVar[str | None] = None

    def parse(self, text: str, final: bool) -> Parsed:
        raise NotImplementedError


def hold_back(text: str, tag: str) -> str:
    """text less any tail that could be the start of tag (it may become the tag)."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return text[:-k]
    return text


def skip_ws(text: str, pos: int) -> int:
    return _WS.match(text, pos).end()


def _decode(text: str, pos: int):
    """(value, end) of the JSON value at pos, or (None, None) while incomplete or invalid (or
    nested past json's recursion: a model can be led to write "[[[[...", and the response
    failed with a RecursionError)."""
    try:
        return _DECODER.raw_decode(text, pos)
    except (ValueError, RecursionError):
        return None, None


def _arguments_text(value) -> str:
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


def read_call(text: str, pos: int) -> tuple[CallText | None, int | None, bool]:
    """The {"name": ..., "arguments": ...} object at text[pos] ('{').

    Returns (call, end, ok): end is the index past the object once it is complete (None while
    open); call is None while not even the name is known; ok is False for a complete object that
    is not a call. An open call's arguments are the text so far of an object or array value
    (a scalar or string value waits until complete).
    """
    obj, end = _decode(text, pos)
    head = _CALL_HEAD.match(text, pos)
    if end is not None:
        key = next((k for k in ARGUMENT_KEYS if isinstance(obj, dict) and k in obj), None)
        if key is None or not isinstance(obj.get("name"), str):
            return None, end, False
        args = _arguments_text(obj[key])
        if head is not None:
            value, vend = _decode(text, head.end())
            if isinstance(value, (dict, list)):
                args = text[head.end():vend]
        return CallText(obj["name"], args), end, True
    if head is None:
        return None, None, True
    name = json.loads(f'"{head.group(1)}"')
    start = head.end()
    value, vend = _decode(text, start)
    if isinstance(value, (dict, list)):
        args = text[start:vend]
    elif vend is None and text[start:start + 1] in ("{", "["):
        args = text[start:]
    else:
        args = ""
    return CallText(name, args), None, True


def read_call_array(text: str, pos: int) -> tuple[list[CallText], str, int | None]:
    """The JSON array of calls at text[pos] ('['): (calls, state, end) with state "done" (end
    past the ']'), "open" (the text stops inside; the last call may be partial) or "invalid"."""
    calls: list[CallText] = []
    pos = skip_ws(text, pos + 1)
    while pos < len(text):
        ch = text[pos]
        if ch == "]":
            return calls, "done", pos + 1
        if ch != "{":
            return calls, "invalid", None
        call, end, ok = read_call(text, pos)
        if not ok:
            return calls, "invalid", None
        if call is not None:
            calls.append(call)
        if end is None:
            return calls, "open", None
        pos = skip_ws(text, end)
        if pos < len(text):
            if text[pos] == ",":
                pos = skip_ws(text, pos + 1)
            elif text[pos] != "]":
                return calls, "invalid", None
    return calls, "open", None
