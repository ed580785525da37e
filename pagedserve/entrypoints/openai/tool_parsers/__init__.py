"""Tool-call parsers, chosen with `--tool-call-parser NAME` (vLLM's names); one file each.

Each parses the generated text into content and calls, whole or as it grows (base.py says
the contract that makes the streamed deltas add up to the whole-text result).
"""
from __future__ import annotations

from pagedserve.entrypoints.openai.tool_parsers.base import CallText, Parsed, ToolParser
from pagedserve.entrypoints.openai.tool_parsers.hermes import HermesToolParser
from pagedserve.entrypoints.openai.tool_parsers.llama3_json import Llama3JsonToolParser
from pagedserve.entrypoints.openai.tool_parsers.mistral import MistralToolParser
from pagedserve.entrypoints.openai.tool_parsers.phi4_mini_json import Phi4MiniJsonToolParser
from pagedserve.entrypoints.openai.tool_parsers.pythonic import PythonicToolParser

TOOL_PARSERS: dict[str, type[ToolParser]] = {
    p.name: p for p in (HermesToolParser, Llama3JsonToolParser, MistralToolParser, Phi4MiniJsonToolParser,
                        PythonicToolParser)}

__all__ = ["CallText", "Parsed", "ToolParser", "TOOL_PARSERS"]
