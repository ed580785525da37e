"""DeepSeek-R1: its chat template ends the prompt with `<think>`, so the output is reasoning
up to `</think>` (an opening `<think>` the model writes anyway is dropped); without
`</think>` all of it is reasoning."""
from __future__ import annotations

from pagedserve.entrypoints.openai.reasoning_parsers.base import ReasoningParser


class DeepSeekR1ReasoningParser(ReasoningParser):
    name = "deepseek_r1"
    opened_by_template = True
