"""Mistral calls after the `[TOOL_CALLS]` token: a JSON array `[{"name": ..., "arguments":
{...}}, ...]` (v3 tokenizers), or `name[ARGS]{...}` per call (v11+ tokenizers). Content is the
text before the token. Its markers are special tokens, so the text keeps special tokens."""
from __future__ import annotations

from pagedserve.entrypoints.openai.tool_parsers.base import (CallText, Parsed, ToolParser, _decode,
                                                             hold_back, read_call_array, skip_ws)

TOOL_CALLS, ARGS = "[TOOL_CALLS]", "[ARGS]"


class MistralToolParser(ToolParser):
    name = "mistral"
    keeps_special_tokens = True

    def parse(self, text: str, final: bool) -> Parsed:
        first = text.find(TOOL_CALLS)
        if first < 0:
            return Parsed(text if final else hold_back(text, TOOL_CALLS))
        result = Parsed(text[:first])
        pos = skip_ws(text, first + len(TOOL_CALLS))
        if text.startswith("[", pos):
            calls, state, _ = read_call_array(text, pos)
            if state == "invalid" or (final and state == "open"):
                return Parsed(text) if final else result
            result.calls = calls
            return result
        while True:  # name[ARGS]{...}, repeated after [TOOL_CALLS]
            mark = text.find(ARGS, pos)
            if mark < 0:
                if final and pos < len(text):
                    return Parsed(text)
                return result
            name = text[pos:mark].strip()
            start = skip_ws(text, mark + len(ARGS))
            value, end = _decode(text, start)
            if end is None:
                if final:
                    return Parsed(text)
                if text.startswith(("{", "["), start):
                    result.calls.append(CallText(name, text[start:]))
                return result
            args = text[start:end] if isinstance(value, (dict, list)) else ""
            result.calls.append(CallText(name, args))
            pos = skip_ws(text, end)
            if not text.startswith(TOOL_CALLS, pos):
                return result
            pos = skip_ws(text, pos + len(TOOL_CALLS))
