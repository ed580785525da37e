"""A chat request -> its prompt ids, exactly as the server renders them.

One function for everyone who needs those ids: the replica's /v1/chat/completions and /tokenize
(serving_chat.OpenAIServingChat._render) and the DP router's routing key
(serving/prefix_key.py). The router hashes the ids to find the replica whose prefix cache holds
them, so any difference between two renderings would silently send the request elsewhere.
"""
from __future__ import annotations

from typing import Any

from pagedserve.entrypoints.openai.chat_tokens import SpecialTokenInContent, content_format, render_chat_ids
from pagedserve.entrypoints.openai.serving_common import APIError
from pagedserve.entrypoints.openai.tools import history_message

# apply_chat_template's own arguments: chat_template_kwargs may not replace them.
TEMPLATE_ARGS = frozenset({"conversation", "messages", "tools", "documents", "chat_template",
                           "add_generation_prompt", "continue_final_message", "tokenize",
                           "padding", "truncation", "max_length", "return_tensors",
                           "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs"})


def render_request_ids(tokenizer: Any, req: Any, content_format_setting: str,
                       tools: list[dict] | None = None) -> list[int]:
    """Prompt ids of req (a ChatCompletionRequest, or /tokenize's messages request: messages,
    add_generation_prompt, continue_final_message, chat_template_kwargs, add_special_tokens) by
    the tokenizer's chat template. content_format_setting: --chat-template-content-format
    (chat_tokens.content_format); tools: as the template takes them (tools.plan_tools'
    ToolPlan.tools). APIError (400) where the request cannot be rendered."""
    messages, kwargs = _template_inputs(tokenizer, req, content_format_setting)
    try:
        return render_chat_ids(tokenizer, messages, req.add_generation_prompt,
                               bool(getattr(req, "add_special_tokens", False)), tools=tools,
                               continue_final_message=req.continue_final_message, **kwargs)
    except SpecialTokenInContent as e:
        raise APIError(str(e), param=str(e).split(":", 1)[0]) from None
    except Exception as e:  # jinja raises for conversations its template refuses
        raise APIError(f"messages could not be rendered by the chat template: {e}",
                       param="messages") from None


def render_request_text(tokenizer: Any, req: Any, content_format_setting: str,
                        tools: list[dict] | None = None) -> str:
    """The chat template's text for req, as render_request_ids renders it before tokenizing
    (vLLM's return_prompt_text): message text shown as written, no special tokens added."""
    messages, kwargs = _template_inputs(tokenizer, req, content_format_setting)
    return tokenizer.apply_chat_template(messages, add_generation_prompt=req.add_generation_prompt,
                                         tokenize=False, tools=tools,
                                         continue_final_message=req.continue_final_message, **kwargs)


def _template_inputs(tokenizer: Any, req: Any, content_format_setting: str) -> tuple[list[dict], dict]:
    if not getattr(tokenizer, "chat_template", None):
        raise APIError("this model's tokenizer has no chat template: start the server with "
                       "--chat-template, or use /v1/completions",
                       param="messages")
    fmt = content_format(tokenizer, content_format_setting)
    messages = [history_message(m, fmt) for m in req.messages]
    kwargs = dict(req.chat_template_kwargs or {})
    clash = sorted(TEMPLATE_ARGS & set(kwargs))
    if clash:
        raise APIError(f"chat_template_kwargs may not set {', '.join(clash)}",
                       param="chat_template_kwargs")
    return messages, kwargs
