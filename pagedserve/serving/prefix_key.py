"""The routing key of a request: chained hashes of its prompt's first full KV blocks.

The chain is the engine's own (core.block_pool.hash_block_tokens), so equal keys mean the
replica that served the first request holds exactly those blocks in its prefix cache.
The prompt is tokenized the way the replica's server will tokenize it (plain completions:
the tokenizer with special tokens unless add_special_tokens is false; chat: the replica's own
rendering, chat_render.py, with the replicas' chat template, content format and the tools it
would render), and cut as truncate_prompt_tokens and truncation_side cut it there.
"""
from __future__ import annotations

import json
from typing import Any

from pagedserve.core.block_pool import cache_salt_root, hash_block_tokens

# Hashing more blocks than this adds cost and no routing information: groups that share
# 64 blocks already share their placement.
MAX_ROUTING_BLOCKS = 64


def prefix_block_hashes(token_ids: list[int], block_size: int,
                        max_blocks: int = MAX_ROUTING_BLOCKS, cache_salt: str | None = None) -> list[bytes]:
    """Hashes of the first min(len // block_size, max_blocks) full blocks, chained (from the
    request's cache_salt, as the engine chains them)."""
    hashes: list[bytes] = []
    parent = cache_salt_root(cache_salt)
    for i in range(min(len(token_ids) // block_size, max_blocks)):
        parent = hash_block_tokens(parent, token_ids[i * block_size:(i + 1) * block_size])
        hashes.append(parent)
    return hashes


def kept_prompt_ids(tokenizer: Any, prompt: str | list[int], truncate_prompt_tokens: int | None,
                    side: Any = None, add_special_tokens: Any = True) -> list[int]:
    """The ids a replica keeps of a prompt (text, or token ids: a chat's rendered ones among
    them) under truncate_prompt_tokens: what it caches, so what the key hashes. The replica's own
    function decides (input_processor.truncated_prompt): a text prompt keeps the BOS its tokenizer
    adds. -1 means max_model_len - max_tokens, which the router does not know: it keys the whole
    prompt, the same ids whenever the prompt fits (a longer one the replica cuts or refuses, its
    answer either way). 0 keys the whole prompt too, and a value past the replica's bound keys
    that many ids: the replica answers both with a 400 whatever the key. side and
    add_special_tokens: the request's truncation_side and (a completion's) add_special_tokens;
    values the replica refuses key as their defaults."""
    from pagedserve.engine.input_processor import truncated_prompt
    keep = truncate_prompt_tokens if isinstance(truncate_prompt_tokens, int) and truncate_prompt_tokens > 0 else None
    side = side if side in ("left", "right") else None
    return truncated_prompt(tokenizer, prompt, keep, side=side, add_special_tokens=add_special_tokens is not False)[0]


def _chat_tools(req: Any) -> list[dict] | None:
    """The tools a replica renders into req's prompt: plan_tools' own, as create() computes
    them. The router does not know the replicas' --tool-call-parser, without which plan_tools
    refuses tool_choice=auto (the default with tools); a replica that has one renders exactly
    rendered_tools(req), and one that has none answers 400 whatever the key."""
    from pagedserve.entrypoints.openai.serving_common import APIError
    from pagedserve.entrypoints.openai.tools import AUTO_NEEDS_FLAGS, plan_tools, rendered_tools
    try:
        return plan_tools(req, None).tools
    except APIError as e:
        if e.message != AUTO_NEEDS_FLAGS:
            raise
        return rendered_tools(req)


def chat_token_ids(tokenizer: Any, req: Any, content_format_setting: str = "auto") -> list[int]:
    """Prompt ids of a validated ChatCompletionRequest exactly as a replica renders them
    (chat_render.render_request_ids, the replica's own function, with the replicas'
    --chat-template-content-format and the tools it would render); [] without a tokenizer or
    when the request cannot be rendered: the router never rejects, the replica answers it."""
    if tokenizer is None:
        return []
    try:
        from pagedserve.entrypoints.openai.chat_render import render_request_ids
        return render_request_ids(tokenizer, req, content_format_setting, _chat_tools(req))
    except Exception:  # a body the replica will refuse (its 400) is routed by load
        return []


def request_token_ids(tokenizer: Any, path: str, raw_body: bytes, content_format_setting: str = "auto") -> list[int]:
    """Prompt token ids of an OpenAI request body (the first prompt of a batch): those its
    truncate_prompt_tokens keeps (kept_prompt_ids); [] when the body is not one the router can
    read: the replica then answers it (with a 4xx if bad).
    content_format_setting: the replicas' --chat-template-content-format (chat bodies)."""
    try:
        body = json.loads(raw_body)
        if not isinstance(body, dict):
            return []
        if path.endswith("/chat/completions"):
            if tokenizer is None:
                return []
            from pagedserve.entrypoints.openai.protocol import ChatCompletionRequest
            req = ChatCompletionRequest.model_validate(body)
            return kept_prompt_ids(None, chat_token_ids(tokenizer, req, content_format_setting),
                                   req.truncate_prompt_tokens, req.truncation_side)
        prompt = body.get("prompt")
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
            prompt = prompt[0]
        keep, side = body.get("truncate_prompt_tokens"), body.get("truncation_side")
        if isinstance(prompt, str):
            return [] if tokenizer is None or not prompt else kept_prompt_ids(
                tokenizer, prompt, keep, side, body.get("add_special_tokens", True))
        if isinstance(prompt, list) and all(type(t) is int and 0 <= t < 2**31 for t in prompt):
            # (ids outside int32 are the replica's 400 to answer, not a hash error)
            return kept_prompt_ids(None, prompt, keep, side)
    except Exception:  # the router never rejects: a body it cannot read is routed by load
        return []
    return []


def tokenizer_path(config: Any) -> str | None:
    return None if config.skip_tokenizer_init else (config.tokenizer or config.model)


def load_tokenizer_path(path: str | None, chat_template: str | None = None) -> Any:
    """The replicas' tokenizer, for routing keys; None without one (skip_tokenizer_init: then
    only token-id prompts have a key, text prompts are routed by load). chat_template: the
    replicas' --chat-template, so chat prompts are keyed as they render them."""
    if path is None:
        return None
    # The engine's loader: the same tokenizer the replicas use, with transformers' own length
    # warning lifted (the replicas refuse an over-long prompt by max_model_len themselves).
    from pagedserve.engine.input_processor import load_tokenizer as load_engine_tokenizer
    return load_engine_tokenizer(path, chat_template)


def load_tokenizer(config: Any) -> Any:
    return load_tokenizer_path(tokenizer_path(config), config.chat_template)
