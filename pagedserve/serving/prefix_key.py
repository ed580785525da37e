"""The routing key of a request: chained hashes of its prompt's first full KV blocks.

The chain is the engine's own (core.block_pool.hash_block_tokens), so equal keys mean the
replica that served the first request holds exactly those blocks in its prefix cache.
The prompt is tokenized the way the replica's server will tokenize it (plain completions:
the tokenizer with special tokens; chat: the chat template, then no special tokens).
"""
from __future__ import annotations

import json
from typing import Any

from pagedserve.core.block_pool import hash_block_tokens

# Hashing more blocks than this adds cost and no routing information: groups that share
# 64 blocks already share their placement.
MAX_ROUTING_BLOCKS = 64


def prefix_block_hashes(token_ids: list[int], block_size: int,
                        max_blocks: int = MAX_ROUTING_BLOCKS) -> list[bytes]:
    """Hashes of the first min(len // block_size, max_blocks) full blocks, chained."""
    hashes: list[bytes] = []
    parent = None
    for i in range(min(len(token_ids) // block_size, max_blocks)):
        parent = hash_block_tokens(parent, token_ids[i * block_size:(i + 1) * block_size])
        hashes.append(parent)
    return hashes


def _chat_text(tokenizer: Any, body: dict) -> str | None:
    if not getattr(tokenizer, "chat_template", None):
        return None
    messages = []
    for m in body.get("messages") or []:
        if not isinstance(m, dict):
            return None
        content = m.get("content")
        if isinstance(content, list):
            content = "\n".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
        messages.append({"role": m.get("role", "user"), "content": content or ""})
    return tokenizer.apply_chat_template(messages, add_generation_prompt=body.get(
        "add_generation_prompt", True), tokenize=False)


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
            text = _chat_text(tokenizer, body)
            return [] if text is None else list(tokenizer(text, add_special_tokens=False).input_ids)
        prompt = body.get("prompt")
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
            prompt = prompt[0]
        if isinstance(prompt, str):
            return [] if tokenizer is None else list(tokenizer(prompt).input_ids)
        if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            return prompt
    except Exception:  # the router never rejects: a body it cannot read is routed by load
        return []
    return []
