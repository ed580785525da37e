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


def render_chat_ids(tok: Any, messages: list[dict], add_generation_prompt: bool, **template_kwargs: Any) -> list[int]:
    """Prompt ids of messages ({"role", "content", "name"?, ...}); ValueError from the template, or
    SpecialTokenInContent where the safe path cannot apply. template_kwargs go to the chat
    template as they are (tools, continue_final_message, chat_template_kwargs)."""
    pattern = _special_pattern(tok)
    marked = [i for i, m in enumerate(messages)
              if pattern is not None and pattern.search(m.get("content") or "")]
    if pattern is not None:
        _refuse_special_text(pattern, messages, template_kwargs.get("tools"))
    if not marked:
        text = tok.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=False,
                                       **template_kwargs)
        # The template already holds any special tokens it wants (BOS and all).
        return list(tok(text, add_special_tokens=False).input_ids)
    nonce = uuid.uuid4().hex
    holders = {i: f"@@pagedserve-content-{nonce}-{i}@@" for i in marked}
    shown = [dict(m, content=holders[i]) if i in holders else m for i, m in enumerate(messages)]
    text = tok.apply_chat_template(shown, add_generation_prompt=add_generation_prompt, tokenize=False,
                                   **template_kwargs)
    ids: list[int] = []
    rest = text
    for i in marked:
        before, sep, after = rest.partition(holders[i])
        if not sep or holders[i] in after:
            raise SpecialTokenInContent(
                f"messages.{i}.content: contains special-token text "
                f"({pattern.search(messages[i]['content']).group()!r}) and this model's chat template "
                "transforms message content, so it cannot be kept as plain text; remove it")
        ids += tok(before, add_special_tokens=False).input_ids
        ids += tok(messages[i]["content"], add_special_tokens=False, split_special_tokens=True).input_ids
        rest = after
    ids += tok(rest, add_special_tokens=False).input_ids
    return list(ids)
