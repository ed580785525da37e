"""Reasoning parsers, chosen with `--reasoning-parser NAME` (vLLM's names): they split
`<think>...</think>` text into the message's `reasoning_content`."""
from __future__ import annotations

from pagedserve.entrypoints.openai.reasoning_parsers.base import ReasoningParser
from pagedserve.entrypoints.openai.reasoning_parsers.deepseek_r1 import DeepSeekR1ReasoningParser
from pagedserve.entrypoints.openai.reasoning_parsers.qwen3 import Qwen3ReasoningParser

REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    p.name: p for p in (Qwen3ReasoningParser, DeepSeekR1ReasoningParser)}

__all__ = ["ReasoningParser", "REASONING_PARSERS"]
