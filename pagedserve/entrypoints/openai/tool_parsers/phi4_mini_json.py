"""Phi-4-mini's calls: `functools[{"name": ..., "arguments": {...}}, ...]`, a JSON array after the
word `functools` (plain text, not a special token). Content is the text before it. vLLM's parser
of the same name reads only whole texts; this one streams too (base.py's contract)."""
from __future__ import annotations

from pagedserve.entrypoints.openai.tool_parsers.base import Parsed, ToolParser, hold_back, read_call_array

MARK = "functools["


class Phi4MiniJsonToolParser(ToolParser):
    name = "phi4_mini_json"

    def parse(self, text: str, final: bool) -> Parsed:
        first = text.find(MARK)
        if first < 0:
            return Parsed(text if final else hold_back(text, MARK))
        result = Parsed(text[:first])
        calls, state, _ = read_call_array(text, first + len(MARK) - 1)
        if state == "invalid" or (final and state == "open"):
            return Parsed(text) if final else result
        result.calls = calls
        return result
