"""Calls written as a Python list of keyword calls, `[get_weather(city="Paris"), get_time()]`
(vLLM's `pythonic`: Llama 3.2 and 4, Gemma 3 prompted for it), the whole reply being that list
(Llama 4 may wrap it in <|python_start|> ... <|python_end|>, special tokens, dropped from the text).
Each call is read with Python's own parser (`ast`): keyword arguments only, literal values
(strings, numbers, True/False/None, lists, tuples, dicts), sent as JSON. A reply that is not such a
list is content.

Streamed, a call is sent once its closing parenthesis is in: its arguments are JSON re-serialized
from Python literals, not a slice of the text, so no prefix of them is known before the call ends
(base.py's contract holds: calls are only appended). While the reply may still become a list
(it starts with `[` and a call's name), its content is held back."""
from __future__ import annotations

import ast
import json
import re

from pagedserve.entrypoints.openai.tool_parsers.base import CallText, Parsed, ToolParser, skip_ws

_NAME = re.compile(r"[A-Za-z_]\w*")
_OPEN, _CLOSE = "([{", ")]}"
_WRAP = ("<|python_start|>", "<|python_end|>")


def _call_end(text: str, pos: int) -> int | None:
    """The index past the ')' closing the '(' at pos (brackets and string literals skipped), or
    None while the text stops inside; -1 where brackets mismatch."""
    stack, i, quote = [], pos, None
    while i < len(text):
        ch = text[i]
        if quote:
            if ch == "\\":
                i += 1
            elif ch == quote:
                quote = None
        elif ch in "'\"":
            quote = ch
        elif ch in _OPEN:
            stack.append(_CLOSE[_OPEN.index(ch)])
        elif ch in _CLOSE:
            if not stack or stack.pop() != ch:
                return -1
            if not stack:
                return i + 1
        i += 1
    return None


def _read(source: str) -> CallText | None:
    """A call `name(key=literal, ...)` as name and JSON arguments, or None if it is not one."""
    try:
        node = ast.parse(source, mode="eval").body
    except (SyntaxError, RecursionError, MemoryError):  # (the last two: nested past the parser's limits)
        return None
    if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args:
        return None
    try:
        args = {kw.arg: ast.literal_eval(kw.value) for kw in node.keywords}
        if None in args:  # **kwargs
            return None
        return CallText(node.func.id, json.dumps(args, ensure_ascii=False))
    except (ValueError, TypeError, SyntaxError, RecursionError):  # not literals, or not JSON (a set, bytes)
        return None


def _is_prefix_of_any(tail: str, words: tuple[str, ...]) -> bool:
    return any(w.startswith(tail) for w in words)


class PythonicToolParser(ToolParser):
    name = "pythonic"

    def parse(self, text: str, final: bool) -> Parsed:
        start = skip_ws(text, 0)
        if text.startswith(_WRAP[0], start):
            start = skip_ws(text, start + len(_WRAP[0]))
        elif not final and _is_prefix_of_any(text[start:], _WRAP[:1]) and start < len(text):
            return Parsed()
        if start == len(text):
            return Parsed(text if final else "")
        if text[start] != "[":
            return Parsed(text)
        calls, state = self._calls(text, start + 1)
        if state == "done":
            return Parsed("", calls)
        if final or (state == "invalid" and not calls):
            return Parsed(text)  # not a call list (or one cut off): content, as vLLM's parser
        return Parsed("", calls)  # open (or invalid after calls already streamed: base.py's exception)

    @staticmethod
    def _calls(text: str, pos: int) -> tuple[list[CallText], str]:
        """The calls from pos (just past '['), and "done", "open" or "invalid"."""
        calls: list[CallText] = []
        while True:
            pos = skip_ws(text, pos)
            name = _NAME.match(text, pos)
            if name is None:
                return calls, "open" if pos == len(text) else "invalid"
            paren = skip_ws(text, name.end())
            if paren == len(text):
                return calls, "open"
            if text[paren] != "(":
                return calls, "invalid"
            end = _call_end(text, paren)
            if end is None:
                return calls, "open"
            call = _read(text[name.start():end]) if end > 0 else None
            if call is None:
                return calls, "invalid"
            calls.append(call)
            pos = skip_ws(text, end)
            if pos == len(text):
                return calls, "open"
            if text[pos] == ",":
                pos += 1
                continue
            if text[pos] != "]":
                return calls, "invalid"
            rest = text[pos + 1:].strip()
            if rest.startswith(_WRAP[1]):
                rest = rest[len(_WRAP[1]):].strip()
            if not rest:
                return calls, "done"
            return calls, "open" if _is_prefix_of_any(rest, _WRAP[1:]) else "invalid"
