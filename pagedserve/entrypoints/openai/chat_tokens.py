"""Chat messages -> prompt token ids, with no way for message text to become a control token.

The chat template renders messages into text, and tokenizing that text parses special tokens
wherever they appear: a user who types `</s>` or `<|system|>` in a message would get the real
control tokens, and could fake a turn of another role. Here (as transformers' chat templating
with `split_special_tokens`, and vLLM's handling, intend) text that comes from a message is
always encoded as text:

- no message holds the text of an added token (the usual case): the rendered text is
  tokenized as it always was, so ids are unchanged;
- otherwise the template is rendered with a random placeholder for each message's content;
  the template's own text is tokenized with its special tokens, each content with
  `split_special_tokens=True` (its `</s>` becomes the characters `<`, `/`, `s`, `>`).
  A template that transforms content beyond recognition (so a placeholder does not come back
  exactly once) makes such a request a 400, never a silent injection.
"""
from __future__ import annotations

import json
import re
import uuid
from typing import Any

_PATTERNS: dict[int, re.Pattern | None] = {}


class SpecialTokenInContent(ValueError):
    pass


def _special_pattern(tok: Any) -> re.Pattern | None:
    """A regex of every added token's text (control tokens are added tokens), cached per tokenizer."""
    key = id(tok)
    if key not in _PATTERNS:
        texts = sorted((t for t in getattr(tok, "added_tokens_encoder", {}) if t), key=len, reverse=True)
        _PATTERNS[key] = re.compile("|".join(map(re.escape, texts))) if texts else None
    return _PATTERNS[key]


def _refuse_special_text(pattern: re.Pattern, messages: list[dict], tools: Any) -> None:
    """Text the template renders outside a message's content (names, tool calls and their ids,
    reasoning, the tools' definitions) has no safe path: special-token text there is a 400
    naming the field, never a control token."""
    def check(field: str, value: Any) -> None:
        text = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
        m = pattern.search(text)
        if m:
            raise SpecialTokenInContent(f"{field}: must not contain a special token ({m.group()!r})")

    for i, msg in enumerate(messages):
        for key in ("name", "tool_call_id", "reasoning_content", "tool_calls"):
            if msg.get(key):
                check(f"messages.{i}.{key}", msg[key])
    if tools:
        check("tools", tools)


def _texts(content: Any) -> list[tuple[int | None, str]]:
    """(part index or None for a plain string, text) of a message's content in either format."""
    if isinstance(content, str):
        return [(None, content)]
    return [(j, p.get("text") or "") for j, p in enumerate(content or []) if isinstance(p, dict)]


def _with_text(content: Any, j: int | None, text: str) -> Any:
    if j is None:
        return text
    return [dict(p, text=text) if k == j else p for k, p in enumerate(content)]


def render_chat_ids(tok: Any, messages: list[dict], add_generation_prompt: bool,
                    add_special_tokens: bool = False, **template_kwargs: Any) -> list[int]:
    """Prompt ids of messages ({"role", "content", "name"?, ...}; content a string, or OpenAI's
    list of text parts: content_format); ValueError from the template, or SpecialTokenInContent
    where the safe path cannot apply. add_special_tokens: vLLM's chat field, the tokenizer's own
    special tokens (a BOS) added to the rendered text's. template_kwargs go to the chat template
    as they are (tools, continue_final_message, chat_template_kwargs)."""
    pattern = _special_pattern(tok)
    marked = [(i, j, text) for i, m in enumerate(messages) for j, text in _texts(m.get("content"))
              if pattern is not None and pattern.search(text)]
    if pattern is not None:
        _refuse_special_text(pattern, messages, template_kwargs.get("tools"))
    if not marked:
        text = tok.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=False,
                                       **template_kwargs)
        # The template already holds any special tokens it wants (BOS and all).
        return list(tok(text, add_special_tokens=add_special_tokens).input_ids)
    nonce = uuid.uuid4().hex
    holders = [f"@@pagedserve-content-{nonce}-{n}@@" for n in range(len(marked))]
    shown = [dict(m) for m in messages]
    for (i, j, _), holder in zip(marked, holders):
        shown[i]["content"] = _with_text(shown[i]["content"], j, holder)
    text = tok.apply_chat_template(shown, add_generation_prompt=add_generation_prompt, tokenize=False,
                                   **template_kwargs)
    ids: list[int] = []
    rest = text
    for (i, j, content), holder in zip(marked, holders):
        before, sep, after = rest.partition(holder)
        if not sep or holder in after:
            where = f"messages.{i}.content" + (f".{j}.text" if j is not None else "")
            raise SpecialTokenInContent(
                f"{where}: contains special-token text ({pattern.search(content).group()!r}) and this "
                "model's chat template transforms message content, so it cannot be kept as plain text; remove it")
        ids += tok(before, add_special_tokens=False).input_ids
        ids += tok(content, add_special_tokens=False, split_special_tokens=True).input_ids
        rest = after
    ids += tok(rest, add_special_tokens=False).input_ids
    return with_special_tokens(tok, ids) if add_special_tokens else list(ids)


def with_special_tokens(tok: Any, ids: list[int]) -> list[int]:
    """ids inside the special tokens tok adds around a text (a BOS before it, ...), found by
    tokenizing one word with and without them: what tokenizing the whole text with
    add_special_tokens=True adds, for the piecewise rendering above."""
    plain = tok("a", add_special_tokens=False).input_ids
    full = tok("a", add_special_tokens=True).input_ids
    for start in range(len(full) - len(plain) + 1):
        if full[start:start + len(plain)] == plain:
            return list(full[:start]) + list(ids) + list(full[start + len(plain):])
    return list(ids)


_DETECTED: dict[str, str] = {}


def content_format(tok: Any, setting: str, template: str | None = None) -> str:
    """"string" (a message's text parts joined by newlines) or "openai" (its content as a list of
    {"type": "text", "text"} parts) — vLLM's --chat-template-content-format. auto: "openai" where the
    template loops over a message's content (it was written for lists of parts), else "string"."""
    if setting != "auto":
        return setting
    source = template if template is not None else getattr(tok, "chat_template", None)
    if isinstance(source, dict):  # named templates: the default one renders chat
        source = source.get("default")
    if not isinstance(source, str):
        return "string"
    if source not in _DETECTED:
        _DETECTED[source] = "openai" if _loops_over_content(source) else "string"
    return _DETECTED[source]


def _loops_over_content(source: str) -> bool:
    """Whether the template has `{% for x in <anything>['content'] %}` (or `.content`), directly
    or through a variable set from one, found in jinja2's own parse tree."""
    import jinja2
    from jinja2 import nodes
    try:
        tree = jinja2.Environment().parse(source)
    except jinja2.TemplateSyntaxError:
        return False

    def is_content(node: Any) -> bool:
        return (isinstance(node, nodes.Getitem) and isinstance(node.arg, nodes.Const) and node.arg.value == "content") \
            or (isinstance(node, nodes.Getattr) and node.attr == "content")
    aliases = {a.target.name for a in tree.find_all(nodes.Assign)
               if isinstance(a.target, nodes.Name) and is_content(a.node)}
    return any(is_content(f.iter) or (isinstance(f.iter, nodes.Name) and f.iter.name in aliases)
               for f in tree.find_all(nodes.For))
