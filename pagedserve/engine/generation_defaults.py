"""--generation-config (vLLM's flag; default auto): the sampling settings a model's creators
ship in generation_config.json (Llama-3.1-Instruct: temperature 0.6, top_p 0.9) become the
defaults of every request that leaves them unset, as vLLM makes them, on the OpenAI server and
in LLM.generate / LLM.chat called without sampling_params. `vllm` keeps pagedserve's own
defaults (temperature 1.0, ...); a folder's path reads that folder's generation_config.json.
--override-generation-config (JSON) sets or replaces any of them, in every mode.

Only these keys are taken: temperature, top_p, top_k, min_p, repetition_penalty, and
max_new_tokens as the default max_tokens. A request's own value always wins (unlike vLLM, an
explicit max_tokens is not capped by max_new_tokens: it was asked for, so it is honoured).
"""
from __future__ import annotations

import json
import logging
import os
from typing import Any

logger = logging.getLogger(__name__)

SAMPLING_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
GENERATION_CONFIG_FILE = "generation_config.json"


def _read(folder: str, required: bool) -> dict:
    path = os.path.join(folder, GENERATION_CONFIG_FILE)
    try:
        with open(path, encoding="utf-8") as f:
            values = json.load(f)
    except FileNotFoundError:
        if required:
            raise ValueError(f"generation_config: no {GENERATION_CONFIG_FILE} in {folder!r}") from None
        return {}
    except (OSError, ValueError) as e:
        raise ValueError(f"generation_config: cannot read {path!r}: {e}") from None
    if not isinstance(values, dict):
        raise ValueError(f"generation_config: {path!r} holds no JSON object")
    return values


def generation_defaults(model_dir: str | None, generation_config: str = "auto",
                        override: dict | None = None) -> dict[str, Any]:
    """SamplingParams keyword arguments (a subset of SAMPLING_KEYS and max_tokens) that requests
    take when they leave those unset; ValueError names the field or file of a bad value."""
    if generation_config == "vllm" or model_dir is None and generation_config == "auto":
        values: dict = {}
    elif generation_config == "auto":
        values = _read(model_dir, required=False)
    else:
        values = _read(generation_config, required=True)
    values = {**values, **(override or {})}
    out = {k: values[k] for k in SAMPLING_KEYS if values.get(k) is not None}
    if values.get("max_new_tokens") is not None:
        out["max_tokens"] = values["max_new_tokens"]
    from pagedserve.sampling_params import SamplingParams
    try:
        SamplingParams(**out)
    except (TypeError, ValueError) as e:
        raise ValueError(f"generation_config: its sampling defaults {out} are not valid: {e}") from None
    return out


def config_generation_defaults(config: Any) -> dict[str, Any]:
    """generation_defaults of an EngineConfig, logged once where any apply."""
    out = generation_defaults(config.model, config.generation_config, config.override_generation_config)
    if out:
        logger.info("default sampling from the model's generation config: %s (a request's own values "
                    "win; --generation-config vllm turns this off)",
                    ", ".join(f"{k}={v}" for k, v in out.items()))
    return out
