"""--chat-template (vLLM's flag): a Jinja chat template that replaces the tokenizer's own, for
/v1/chat/completions, LLM.chat and the data-parallel router's prefix keys alike.

The value is a file's path or the template itself, told apart as vLLM tells them: a value that
opens as a file is read; one that does not and holds none of `{`, `}` or a newline looks like a
path that is missing (an error naming it); anything else is the template, with its backslash
escapes read (`\\n` typed on a command line is a newline). Every process resolves the value the
user gave (replicas and relay workers get it on their command line), so all render alike.
"""
from __future__ import annotations

from typing import Any

_TEMPLATE_CHARS = ("{", "}", "\n")


def resolve_chat_template(value: str | None, read_escapes: bool = True) -> str | None:
    """The template text of a --chat-template value; ValueError naming the field when the value
    looks like a path that cannot be read. read_escapes=False keeps a template given as text
    exactly as it is (LLM.chat's argument: Python code writes its newlines itself)."""
    if value is None:
        return None
    try:
        with open(value, encoding="utf-8") as f:
            return f.read()
    except (OSError, ValueError) as e:  # ValueError: a NUL in the value (it is no path then)
        if not any(c in value for c in _TEMPLATE_CHARS):
            raise ValueError(f"chat_template: {value!r} looks like a file path, but it cannot be read "
                             f"({e.__class__.__name__}: {getattr(e, 'strerror', None) or e}); pass a "
                             "Jinja file's path or the template itself") from None
    if not read_escapes:
        return value
    # Escapes as Python reads them; characters past latin-1 survive as their own escapes first.
    return value.encode("latin-1", "backslashreplace").decode("unicode_escape")


def apply_chat_template_override(tokenizer: Any, value: str | None) -> None:
    """Sets the tokenizer's chat template from a --chat-template value, and refuses one that does
    not compile (a ValueError with jinja's line and message) now, not at every chat request. A
    template that compiles but refuses the probe conversation is left for requests to meet."""
    text = resolve_chat_template(value)
    if text is None or tokenizer is None:
        return
    import jinja2
    try:
        tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                      add_generation_prompt=True, chat_template=text)
    except jinja2.TemplateSyntaxError as e:
        raise ValueError(f"chat_template: not a valid Jinja template: line {e.lineno}: {e.message}") from None
    except Exception:  # noqa: BLE001  (raise_exception() and the like: a conversation it refuses)
        pass
    tokenizer.chat_template = text
