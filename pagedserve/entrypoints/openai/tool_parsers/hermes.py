"""Hermes-style calls: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, one block per
call (Qwen2.5, Qwen3, NousResearch Hermes). Content is the text before the first block; text
between and after blocks is not part of the message (as vLLM's hermes parser)."""
from __future__ import annotations

from pagedserve.entrypoints.openai.tool_parsers.base import (Parsed, ToolParser, hold_back,
                                                             read_call, skip_ws)

START, END = "<tool_call>", "</tool_call>"


class HermesToolParser(ToolParser):
    name = "hermes"
    xgrammar_format = "qwen_3"

    def parse(self, text: str, final: bool) -> Parsed:
        first = text.find(START)
        if first < 0:
            return Parsed(text if final else hold_back(text, START))
        result = Parsed(text[:first])
        start = first
        while start >= 0:
            body = start + len(START)
            close = text.find(END, body)
            block = text if close < 0 else text[:close]
            pos = skip_ws(block, body)
            closed = close >= 0 or final
            if pos == len(block) and not closed:
                break  # nothing of the call yet
            call, end, ok = read_call(block, pos) if block[pos:pos + 1] == "{" else (None, None, False)
            if not ok or (closed and (end is None or skip_ws(block, end) != len(block))):
                # Not a call after all: the whole text is content, as vLLM answers.
                return Parsed(text) if final else result
            if call is not None:
                result.calls.append(call)
            if close < 0:
                break
            start = text.find(START, close + len(END))
        return result
