"""tools + tool_choice -> what the chat request does: the tools its prompt shows, the grammar that
forces a call (tool_choice "required" or a named function), and the parser of its output.

- none: the model answers in text (the tools are still rendered, as vLLM does by default).
- auto (the default when tools are given): the model decides; the server's --tool-call-parser
  reads calls out of the text. Needs --enable-auto-tool-choice, else 400 (as vLLM). Functions
  marked `strict` are enforced by xgrammar's built-in structural tag of the parser's format
  (text stays free; a call, once begun, follows its schema); a parser without one is a 400.
- required: a JSON schema forces a non-empty array of {"name", "parameters"} items, each with
  the parameters schema of its function (one item with parallel_tool_calls=false).
- a named function: a JSON schema forces the function's parameters object.
Forced arguments therefore always validate against the function's parameter schema.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from pagedserve.entrypoints.openai.protocol import ChatCompletionRequest, NamedToolChoice
from pagedserve.entrypoints.openai.serving_common import APIError
from pagedserve.entrypoints.openai.structured_outputs import check_enforceable, check_json_schema
from pagedserve.entrypoints.openai.tool_parsers import ToolParser
from pagedserve.entrypoints.openai.tool_parsers.forced import (NamedFunctionParser,
                                                               RequiredToolsParser)

EMPTY_PARAMETERS = {"type": "object", "properties": {}}
AUTO_NEEDS_FLAGS = ('"auto" tool choice requires --enable-auto-tool-choice and '
                    '--tool-call-parser to be set')


@dataclass
class ToolPlan:
    """What one request's tools mean for its prompt, its grammar and its output parsing."""
    tools: list[dict] | None = None          # as apply_chat_template(tools=...) takes them
    # (param, StructuredOutputsParams keyword arguments) of the grammar the tools need, if any
    constraint: tuple[str, dict] | None = None
    parser: ToolParser | None = None         # reads the calls out of the output
    parallel: bool = True


def plan_tools(req: ChatCompletionRequest, auto_parser: type[ToolParser] | None) -> ToolPlan:
    """auto_parser: the server's --tool-call-parser when --enable-auto-tool-choice is on."""
    choice = req.tool_choice
    if not req.tools:
        if choice is not None and choice != "none":
            raise APIError("tool_choice needs tools", param="tool_choice")
        return ToolPlan()  # parallel_tool_calls alone has nothing to act on
    names = [t.function.name for t in req.tools]
    dup = next((n for i, n in enumerate(names) if n in names[:i]), None)
    if dup is not None:
        raise APIError(f"tools holds two functions named {dup!r}", param="tools")
    params = []
    for i, t in enumerate(req.tools):
        p = t.function.parameters
        params.append(EMPTY_PARAMETERS if not p else
                      check_json_schema(p, f"tools.{i}.function.parameters"))
    rendered = rendered_tools(req)
    parallel = req.parallel_tool_calls is not False
    if choice is None:
        choice = "auto"
    if choice == "none":
        return ToolPlan(tools=rendered, parallel=parallel)
    # The functions whose arguments a grammar will force (the others' schemas are only shown
    # to the model): each schema must be one the grammar enforces whole.
    forced = [i for i, t in enumerate(req.tools) if choice == "required" or
              (t.function.name == choice.function.name if isinstance(choice, NamedToolChoice)
               else t.function.strict)]
    for i in forced:
        check_enforceable(params[i], f"tools.{i}.function.parameters")
    if choice == "auto":
        if auto_parser is None:
            raise APIError(AUTO_NEEDS_FLAGS, param="tool_choice")
        strict = [i for i, t in enumerate(req.tools) if t.function.strict]
        constraint = None
        if strict:
            constraint = ("tools", {"structural_tag": _strict_tag(auto_parser, req, strict[0],
                                                                  params, parallel)})
        return ToolPlan(tools=rendered, constraint=constraint, parser=auto_parser(),
                        parallel=parallel)
    if isinstance(choice, NamedToolChoice):
        name = choice.function.name
        if name not in names:
            raise APIError(f"tool_choice names function {name!r}, which is not in tools",
                           param="tool_choice")
        schema = params[names.index(name)]
        return ToolPlan(tools=rendered, constraint=("tool_choice", {"json": schema}),
                        parser=NamedFunctionParser(name), parallel=parallel)
    schema = required_schema(names, params, parallel)
    return ToolPlan(tools=rendered, constraint=("tool_choice", {"json": schema}),
                    parser=RequiredToolsParser(), parallel=parallel)


def rendered_tools(req: Any) -> list[dict] | None:
    """req's tools (a chat or /tokenize request's) as the chat template takes them (every plan
    that has tools shows these)."""
    return [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None


def _strict_tag(parser: type[ToolParser], req: ChatCompletionRequest, first_strict: int,
                params: list[dict], parallel: bool) -> dict:
    """xgrammar's structural tag for the parser's call format: strict functions with their
    parameter schemas, the others with any JSON object."""
    if parser.xgrammar_format is None:
        raise APIError(f"strict functions under tool_choice=auto need a tool-call format the "
                       f"grammar can enforce (hermes, llama3_json); the server's parser is "
                       f"{parser.name}. Use tool_choice=required or a named function.",
                       param=f"tools.{first_strict}.function.strict")
    import xgrammar as xgr

    tools = []
    for t, p in zip(req.tools, params):
        fn: dict[str, Any] = {"name": t.function.name}
        if t.function.strict:
            fn["parameters"] = p
        tools.append({"type": "function", "function": fn})
    tag = xgr.get_builtin_structural_tag(parser.xgrammar_format, tools=tools, tool_choice="auto",
                                         reasoning=False, parallel_tool_calls=parallel)
    return tag.model_dump(mode="json")


def required_schema(names: list[str], params: list[dict], parallel: bool) -> dict:
    """A non-empty array of calls, each {"name": one of the functions, "parameters": its schema}.
    Each function's $defs move to the top level, where its "#/$defs/..." references point."""
    defs: dict[str, Any] = {}
    items = []
    for name, p in zip(names, params):
        p = dict(p)
        for k, v in p.pop("$defs", {}).items():
            if k in defs and defs[k] != v:
                raise APIError(f"two tools define $defs/{k} differently; tool_choice=required "
                               "needs them to agree", param="tools")
            defs[k] = v
        items.append({"type": "object",
                      "properties": {"name": {"type": "string", "enum": [name]}, "parameters": p},
                      "required": ["name", "parameters"], "additionalProperties": False})
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": items}}
    if not parallel:
        schema["maxItems"] = 1
    if defs:
        schema["$defs"] = defs
    return schema


def history_message(m: Any, content_format: str = "string") -> dict:
    """One request message as the chat template takes it (HF's shape for tool calls: the
    arguments as an object where they parse as one, as vLLM passes them). content_format
    (chat_tokens.content_format): "string" joins text parts by newlines; "openai" passes a list of
    {"type": "text", "text"} parts, a plain string as one part."""
    content = m.content
    if content_format == "openai":
        texts = [content] if isinstance(content, str) else [part.text for part in content or []]
        content = [{"type": "text", "text": t} for t in texts]
    elif isinstance(content, list):
        content = "\n".join(part.text for part in content)
    msg: dict[str, Any] = {"role": m.role, "content": content or ([] if content_format == "openai" else "")}
    if m.name is not None:
        msg["name"] = m.name
    if m.tool_calls:
        calls = []
        for c in m.tool_calls:
            try:
                args: Any = json.loads(c.function.arguments)
            except (ValueError, RecursionError):  # not JSON (or nested past json's recursion): as text
                args = c.function.arguments
            calls.append({"id": c.id, "type": "function",
                          "function": {"name": c.function.name, "arguments": args}})
        msg["tool_calls"] = calls
    if m.tool_call_id is not None:
        msg["tool_call_id"] = m.tool_call_id
    if m.reasoning_content is not None:
        msg["reasoning_content"] = m.reasoning_content
    return msg


def check_history(messages: list[Any]) -> None:
    """OpenAI's rules for tool turns in the history, each a 400 naming the message field."""
    for i, m in enumerate(messages):
        if m.tool_calls and m.role != "assistant":
            raise APIError("only assistant messages carry tool_calls", param=f"messages.{i}.tool_calls")
        if m.role == "tool" and not m.tool_call_id:
            raise APIError("a tool message needs the tool_call_id it answers",
                           param=f"messages.{i}.tool_call_id")
        for field, why in (("audio", "audio is not supported"),
                           ("function_call", "function_call is deprecated: use tool_calls"),
                           ("refusal", "refusal in the history is not supported: send it as "
                                       "content")):
            if getattr(m, field) is not None:
                raise APIError(why, param=f"messages.{i}.{field}")
