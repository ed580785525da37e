"""SpeculativeConfig: vLLM's `--speculative-config` JSON, validated once.

Keys (vLLM's names): method ("ngram" | "draft_model"), num_speculative_tokens (k, >= 1),
model (the draft model's directory, draft_model only), prompt_lookup_min / prompt_lookup_max
(n-gram lengths to match, ngram only; 1 and 5 when neither is given, one given alone sets
both), plus our adaptive
policy's knobs (spec_disable_batch_tokens, min_speculation_yield, and vLLM's
disable_by_batch_size; see spec_decode/policy.py). An unknown key is a
ValueError naming it: a field is honoured or refused, never dropped.

No torch here: EngineConfig validates the JSON at construction, before any model loads.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import Any

METHODS = ("ngram", "draft_model")
# Running decodes + their lookahead tokens above which speculation turns off for a step
# (spec_decode/policy.py explains the default).
DEFAULT_DISABLE_BATCH_TOKENS = 128
# Tokens per speculating row below which speculation pauses (spec_decode/policy.py). A speculating
# step is synchronous: it gives up overlapping the next step's host work (scheduling, output
# processing; 10-30% of a small model's decode step) with the device, and pays the proposer and
# the verification rows. An n-gram step costs roughly a quarter more than an overlapped plain
# one, so it must emit more than ~1.25 tokens per row to pay; below that, a plain step is faster.
DEFAULT_MIN_SPECULATION_YIELD = 1.25


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int
    model: str | None = None
    prompt_lookup_min: int | None = None
    prompt_lookup_max: int | None = None
    # Adaptive policy: above this many batched tokens (decodes x (1 + k)) k is lowered, and
    # speculation is off for a step where even k = 1 would exceed it.
    spec_disable_batch_tokens: int = DEFAULT_DISABLE_BATCH_TOKENS
    # vLLM's key: speculation off for a step once this many requests run (None: no such limit).
    disable_by_batch_size: int | None = None
    # Pause speculation while its steps yield fewer tokens per row than this (<= 1: never pause).
    min_speculation_yield: float = DEFAULT_MIN_SPECULATION_YIELD

    @classmethod
    def from_json(cls, value: str | dict | "SpeculativeConfig") -> "SpeculativeConfig":
        if isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"speculative_config must be a JSON object: {e}") from None
        if not isinstance(value, dict):
            raise ValueError(f"speculative_config must be a JSON object, got {type(value).__name__}")
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"speculative_config: unknown key(s) {', '.join(unknown)} "
                             f"(supported: {', '.join(sorted(known))})")
        d = dict(value)
        method = d.get("method")
        if method is None and d.get("model") is not None:
            method = "ngram" if d["model"] in ("ngram", "[ngram]") else "draft_model"
            if method == "ngram":
                d["model"] = None
        if method not in METHODS:
            raise ValueError(f"speculative_config.method must be one of {METHODS}, got {method!r}")
        d["method"] = method
        k = d.get("num_speculative_tokens")
        if not isinstance(k, int) or isinstance(k, bool) or k < 1:
            raise ValueError(f"speculative_config.num_speculative_tokens must be an integer >= 1, got {k!r}")
        if method == "draft_model":
            if not d.get("model"):
                raise ValueError("speculative_config.model (the draft model's directory) is required for "
                                 "method draft_model")
            for key in ("prompt_lookup_min", "prompt_lookup_max"):
                if d.get(key) is not None:
                    raise ValueError(f"speculative_config.{key} applies to method ngram only")
        else:
            if d.get("model") is not None:
                raise ValueError("speculative_config.model applies to method draft_model only")
            lo, hi = d.get("prompt_lookup_min"), d.get("prompt_lookup_max")
            if lo is None and hi is None:
                lo, hi = 1, 5
            elif lo is None:
                lo = hi
            elif hi is None:
                hi = lo
            for key, v in (("prompt_lookup_min", lo), ("prompt_lookup_max", hi)):
                if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                    raise ValueError(f"speculative_config.{key} must be an integer >= 1, got {v!r}")
            if lo > hi:
                raise ValueError(f"speculative_config.prompt_lookup_min ({lo}) must be <= prompt_lookup_max ({hi})")
            d["prompt_lookup_min"], d["prompt_lookup_max"] = lo, hi
        t = d.get("spec_disable_batch_tokens", DEFAULT_DISABLE_BATCH_TOKENS)
        if not isinstance(t, int) or isinstance(t, bool) or t < 2:
            raise ValueError(f"speculative_config.spec_disable_batch_tokens must be an integer >= 2, got {t!r}")
        d["spec_disable_batch_tokens"] = t
        b = d.get("disable_by_batch_size")
        if b is not None and (not isinstance(b, int) or isinstance(b, bool) or b < 1):
            raise ValueError(f"speculative_config.disable_by_batch_size must be an integer >= 1, got {b!r}")
        y = d.get("min_speculation_yield", DEFAULT_MIN_SPECULATION_YIELD)
        if not isinstance(y, (int, float)) or isinstance(y, bool) or not 0 <= y <= 1 + k:
            raise ValueError("speculative_config.min_speculation_yield must be a number in [0, 1 + "
                             f"num_speculative_tokens] = [0, {1 + k}] (tokens per speculating row), got {y!r}")
        d["min_speculation_yield"] = float(y)
        return cls(**d)

    def to_dict(self) -> dict[str, Any]:
        return {k: v for k, v in asdict(self).items() if v is not None}
