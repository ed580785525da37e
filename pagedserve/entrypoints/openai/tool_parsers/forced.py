"""Parsers of outputs whose shape a grammar forced (tool_choice "required" or a named function);
not chosen by --tool-call-parser. The grammar guarantees the JSON; a text cut short by
max_tokens gives the calls (and arguments) it got to."""
from __future__ import annotations

from pagedserve.entrypoints.openai.tool_parsers.base import (CallText, Parsed, ToolParser,
                                                             read_call_array, skip_ws)


class NamedFunctionParser(ToolParser):
    """The whole output is the arguments of the one named function."""

    def __init__(self, function_name: str) -> None:
        self.function_name = function_name

    def parse(self, text: str, final: bool) -> Parsed:
        return Parsed("", [CallText(self.function_name, text)])


class RequiredToolsParser(ToolParser):
    """The output is a JSON array of {"name": ..., "parameters": {...}} (tools.required_schema)."""

    def parse(self, text: str, final: bool) -> Parsed:
        pos = skip_ws(text, 0)
        if not text.startswith("[", pos):
            return Parsed(text if final else "")
        calls, _, _ = read_call_array(text, pos)
        return Parsed("", calls)
