"""The reasoning parsers' contract: `parse(text, final) -> (reasoning, content)`, prefix-stable
while final is False (see tool_parsers/base.py: the stream sends the differences)."""
from __future__ import annotations

from typing import ClassVar

from pagedserve.entrypoints.openai.tool_parsers.base import hold_back

THINK_START, THINK_END = "<think>", "</think>"


class ReasoningParser:
    name: ClassVar[str] = ""
    # Whether text without the opening tag is reasoning (the chat template opened it already).
    opened_by_template: ClassVar[bool] = False

    def parse(self, text: str, final: bool) -> tuple[str, str]:
        start = len(THINK_START) if text.startswith(THINK_START) else 0
        if start == 0:
            if not final and THINK_START.startswith(text):
                return "", ""  # may still become the opening tag
            if not self.opened_by_template:
                return "", text
        end = text.find(THINK_END, start)
        if end < 0:  # still thinking (or cut off while thinking)
            reasoning = text[start:]
            return (reasoning if final else hold_back(reasoning, THINK_END)), ""
        return text[start:end], text[end + len(THINK_END):]
