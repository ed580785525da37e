"""The routing key of a request: chained hashes of its prompt's first full KV blocks.

The chain is the engine's own (core.block_pool.hash_block_tokens), so equal keys mean the
replica that served the first request holds exactly those blocks in its prefix cache.
The prompt is tokenized the way the replica's server will tokenize it (plain completions:
the tokenizer with special tokens; chat: the chat template, then no special tokens).
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


def _chat_ids(tokenizer: Any, body: dict) -> list[int]:
    """As the replica's serving_chat renders them (chat_tokens.render_chat_ids)."""
    from pagedserve.entrypoints.openai.chat_tokens import render_chat_ids
    if not getattr(tokenizer, "chat_template", None):
        return []
    messages = []
    for m in body.get("messages") or []:
        if not isinstance(m, dict):
            return []
        content = m.get("content")
        if isinstance(content, list):
            content = "\n".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
        msg = {"role": m.get("role", "user"), "content": content or ""}
        if m.get("name") is not None:
            msg["name"] = m["name"]
        messages.append(msg)
    return render_chat_ids(tokenizer, messages, body.get("add_generation_prompt", True))


def request_token_ids(tokenizer: Any, path: str, raw_body: bytes) -> list[int]:
    """Prompt token ids of an OpenAI request body (the first prompt of a batch); [] when the
    body is not one the router can read: the replica then answers it (with a 4xx if bad)."""
    try:
        body = json.loads(raw_body)
        if not isinstance(body, dict):
            return []
        if path.endswith("/chat/completions"):
            if tokenizer is None:
                return []
            return _chat_ids(tokenizer, body)
        prompt = body.get("prompt")
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
            prompt = prompt[0]
        if isinstance(prompt, str):
            return [] if tokenizer is None else list(tokenizer(prompt).input_ids)
        if isinstance(prompt, list) and all(type(t) is int and 0 <= t < 2**31 for t in prompt):
            return prompt  # (ids outside int32 are the replica's 400 to answer, not a hash error)
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
