"""What a draft model must satisfy to run beside the target (spec_decode/draft_model.py refuses
it at start-up otherwise): the same vocabulary, and no wider activations.

Activation memory. The start-up profile (runner/kv_sizing.py) runs only the target's forward of
max_num_batched_tokens tokens; the KV budget is what its peak leaves, with the draft's weights
already loaded. Every draft forward runs between the target's, has at most that many tokens (the
catch-up is capped, the decode steps have one token per sequence) and computes logits for at
most one row per sequence; so its activations stay within the profiled peak as long as the draft
is no wider than the target per token, in the dtype both share: check_draft_not_wider refuses at
start-up a draft whose hidden_size, MLP width or attention widths exceed the target's. (Rather
than profiling the draft's forward too: a draft is smaller by purpose, the check is free, exact on
every device and leaves the runner's profile to the one model the runner owns; a wider draft would
need that second profiled forward and its scratch pool, and gains little as a draft.)
"""
from __future__ import annotations

import json
import os

from pagedserve.models.llama import head_dim_of


def _tokenizer_vocab(model_dir: str | None) -> dict | None:
    """The token -> id map (and added tokens) of a directory's tokenizer.json, or None if it has none."""
    if not model_dir:
        return None
    path = os.path.join(os.fspath(model_dir), "tokenizer.json")
    if not os.path.isfile(path):
        return None
    with open(path, encoding="utf-8") as f:
        tok = json.load(f)
    added = {t["content"]: t["id"] for t in tok.get("added_tokens", [])}
    return {"vocab": (tok.get("model") or {}).get("vocab"), "added": added}


def check_vocab_compatible(draft_cfg, target_cfg, draft_dir: str | None, target_tokenizer_dir: str | None) -> None:
    """Refuse a draft whose vocabulary differs from the target's: proposals are token ids and the
    rejection sampler compares probability rows id by id, so both must mean the same tokens."""
    dv, tv = getattr(draft_cfg, "vocab_size", None), getattr(target_cfg, "vocab_size", None)
    if dv != tv:
        raise ValueError(f"speculative_config.model: the draft model's vocab_size ({dv}) differs from the "
                         f"target's ({tv}); a draft model must share the target's tokenizer and vocabulary")
    if draft_dir and target_tokenizer_dir and os.path.realpath(draft_dir) != os.path.realpath(target_tokenizer_dir):
        d, t = _tokenizer_vocab(draft_dir), _tokenizer_vocab(target_tokenizer_dir)
        if d is not None and t is not None and d != t:
            raise ValueError(f"speculative_config.model: the draft's tokenizer ({draft_dir}/tokenizer.json) "
                             f"maps tokens to ids differently from the target's ({target_tokenizer_dir}); "
                             "a draft model must share the target's tokenizer")


def _widths(cfg) -> dict[str, int]:
    """The per-token widths a dense decoder's activations scale with (OPT names its MLP ffn_dim).
    A mixture-of-experts draft's expert widths are not compared: drafts are dense in practice."""
    heads, head_dim = cfg.num_attention_heads, head_dim_of(cfg)
    kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
    return {"hidden_size": cfg.hidden_size,
            "intermediate_size": getattr(cfg, "intermediate_size", None) or getattr(cfg, "ffn_dim", 0),
            "num_attention_heads x head_dim": heads * head_dim,
            "num_key_value_heads x head_dim": kv_heads * head_dim}


def check_draft_not_wider(draft_cfg, target_cfg) -> None:
    """Refuse a draft wider than the target (see "Activation memory" above): its forwards of up to
    max_num_batched_tokens tokens could then need more activation memory than the profile measured."""
    draft, target = _widths(draft_cfg), _widths(target_cfg)
    for name, width in draft.items():
        if width > target[name]:
            raise ValueError(f"speculative_config.model: the draft model's {name} ({width}) is larger than the "
                             f"target's ({target[name]}); the start-up memory profile covers a draft no wider than "
                             "the target, pick a smaller draft model")
