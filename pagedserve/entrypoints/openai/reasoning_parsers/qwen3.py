"""Qwen3: the model opens `<think>` itself; text that does not start with it (thinking off,
e.g. chat_template_kwargs={"enable_thinking": false}) is all content."""
from __future__ import annotations

from pagedserve.entrypoints.openai.reasoning_parsers.base import ReasoningParser


class Qwen3ReasoningParser(ReasoningParser):
    name = "qwen3"
    opened_by_template = False
