"""Llama 3.x JSON calls: `{"name": ..., "parameters": {...}}`, optionally after
`<|python_tag|>`, several separated by `;`. Output that does not start with a call is content."""
from __future__ import annotations

from pagedserve.entrypoints.openai.tool_parsers.base import Parsed, ToolParser, read_call, skip_ws

PYTHON_TAG = "<|python_tag|>"


class Llama3JsonToolParser(ToolParser):
    name = "llama3_json"
    xgrammar_format = "llama"

    def parse(self, text: str, final: bool) -> Parsed:
        pos = len(PYTHON_TAG) if text.startswith(PYTHON_TAG) else 0
        if not final and (pos == len(text) or pos == 0 and PYTHON_TAG.startswith(text)):
            return Parsed()  # may still become the tag, or calls after it
        if not text.startswith("{", pos):
            return Parsed(text)
        result = Parsed()
        while pos < len(text):
            call, end, ok = read_call(text, pos)
            if not ok or (final and end is None):
                return Parsed(text) if final else result
            if call is not None:
                result.calls.append(call)
            if end is None:
                break
            pos = skip_ws(text, end)
            if not text.startswith(";", pos):
                break  # anything else after the calls is not part of the message
            pos = skip_ws(text, pos + 1)
            if pos < len(text) and text[pos] != "{":
                break
        return result
