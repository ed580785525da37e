"""A choice's generated text -> an OpenAI assistant message: reasoning, content and tool calls,
whole (non-streamed) or as deltas (streamed), through the same parsers.

The parsers are pure, prefix-stable functions of the text so far (tool_parsers/base.py), so the
streamer sends what is new between consecutive parses and ends with the whole-text parse: the
streamed deltas concatenate to the non-streamed message. Each step re-parses the text so far
(O(length) work per step), which only requests with a parser in play pay.
"""
from __future__ import annotations

import logging
import uuid
from dataclasses import dataclass, field

from pagedserve.entrypoints.openai.protocol import (ChatResponseMessage, DeltaFunctionCall,
                                                    DeltaMessage, DeltaToolCall, FunctionCall,
                                                    ToolCall)
from pagedserve.entrypoints.openai.reasoning_parsers import ReasoningParser
from pagedserve.entrypoints.openai.tool_parsers import CallText, ToolParser

logger = logging.getLogger("pagedserve.server")


def tool_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class ParsedMessage:
    reasoning: str = ""
    content: str = ""
    calls: list[CallText] = field(default_factory=list)


@dataclass
class MessageParser:
    """reasoning first (the <think> block), then tool calls in what remains."""
    reasoning: ReasoningParser | None = None
    tools: ToolParser | None = None
    parallel_tool_calls: bool = True

    @property
    def active(self) -> bool:
        return self.reasoning is not None or self.tools is not None

    def parse(self, text: str, final: bool) -> ParsedMessage:
        reasoning, content = "", text
        if self.reasoning is not None:
            reasoning, content = self.reasoning.parse(text, final)
        if self.tools is None:
            return ParsedMessage(reasoning, content)
        parsed = self.tools.parse(content, final)
        calls = parsed.calls if self.parallel_tool_calls else parsed.calls[:1]
        return ParsedMessage(reasoning, parsed.content, calls)

    def message(self, text: str) -> ChatResponseMessage:
        m = self.parse(text, final=True)
        calls = [ToolCall(id=tool_call_id(), function=FunctionCall(name=c.name, arguments=c.arguments))
                 for c in m.calls]
        return ChatResponseMessage(content=m.content or None, reasoning_content=m.reasoning or None,
                                   tool_calls=calls or None)


def finish_reason(reason: str | None, called_tools: bool) -> str | None:
    """A message with tool calls that ended normally finishes with "tool_calls" (OpenAI's)."""
    return "tool_calls" if called_tools and reason == "stop" else reason


class MessageStreamer:
    """One streamed choice: feed it each text delta; it answers the DeltaMessage to send."""

    def __init__(self, parser: MessageParser) -> None:
        self.parser = parser
        self.text = ""
        self.sent = ParsedMessage()
        self.ids: list[str] = []

    @property
    def called_tools(self) -> bool:
        return bool(self.sent.calls)

    def feed(self, delta: str, final: bool) -> DeltaMessage | None:
        self.text += delta
        now = self.parser.parse(self.text, final)
        out = DeltaMessage(reasoning_content=self._new("reasoning", now.reasoning) or None,
                           content=self._new("content", now.content) or None)
        calls = []
        for i, call in enumerate(now.calls):
            if i == len(self.sent.calls):
                self.ids.append(tool_call_id())
                self.sent.calls.append(CallText(call.name, call.arguments))
                calls.append(DeltaToolCall(index=i, id=self.ids[i], type="function",
                                           function=DeltaFunctionCall(name=call.name,
                                                                      arguments=call.arguments)))
                continue
            sent = self.sent.calls[i]
            if call.arguments != sent.arguments and call.arguments.startswith(sent.arguments):
                calls.append(DeltaToolCall(index=i, function=DeltaFunctionCall(
                    arguments=call.arguments[len(sent.arguments):])))
                sent.arguments = call.arguments
        if calls:
            out.tool_calls = calls
        if out.content is None and out.reasoning_content is None and out.tool_calls is None:
            return None
        return out

    def _new(self, part: str, now: str) -> str:
        sent = getattr(self.sent, part)
        if not now.startswith(sent):
            # Only malformed output can do this (a call that turned out not to be one): what
            # was sent stays sent.
            logger.debug("streamed %s diverged from the reparse; not resent", part)
            return ""
        setattr(self.sent, part, now)
        return now[len(sent):]
