"""Build a model from a local HF directory: config via AutoConfig, weights streamed from safetensors.

Weights are read one tensor at a time with safe_open and handed to the owning parameter's
weight_loader as a lazy slice, so a tensor-parallel rank reads only its own part. Pickled
checkpoints are never loaded; remote code is never run; nothing is fetched from a hub.
"""
from __future__ import annotations

import glob
import json
import logging
import os
from contextlib import contextmanager
from typing import Iterable, Iterator

import torch
from torch import nn

from pagedserve.layers.weights import default_weight_loader
from pagedserve.models.registry import get_model_class

# Re-exported: the torch-free checks of a model directory live in hf_dir.py (preflight uses them).
from pagedserve.models.hf_dir import (PICKLE_PATTERNS, SAFETENSORS_INDEX, get_max_model_len,  # noqa: F401
                                      read_config_json, safetensors_files)

logger = logging.getLogger(__name__)


def load_hf_config(model_dir: str | os.PathLike):
    """The model's PretrainedConfig, from a local directory only (no hub, no remote code)."""
    from transformers import AutoConfig

    model_dir = os.fspath(model_dir)
    read_config_json(model_dir)  # one line naming the spot for a missing or broken file, not HF's traceback
    path = os.path.join(model_dir, "config.json")
    try:
        return AutoConfig.from_pretrained(model_dir, trust_remote_code=False, local_files_only=True)
    except (OSError, KeyError) as e:
        raise ValueError(f"model: {path} could not be read as a transformers config ({e})") from None


_DTYPES = {"float32": torch.float32, "float": torch.float32, "fp32": torch.float32,
           "float16": torch.float16, "half": torch.float16, "fp16": torch.float16,
           "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}


def resolve_dtype(dtype: str | torch.dtype, hf_config, device: torch.device | str) -> torch.dtype:
    """"auto": float32 on CPU; on CUDA float16 if the checkpoint is float16, else bfloat16."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype != "auto":
        if dtype not in _DTYPES:
            raise ValueError(f"dtype must be auto, float32, float16 or bfloat16, got {dtype!r}")
        return _DTYPES[dtype]
    if torch.device(device).type == "cpu":
        return torch.float32
    cfg = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
    if cfg in (torch.float16, "float16"):
        return torch.float16
    return torch.bfloat16


@contextmanager
def _building_on(device: torch.device, dtype: torch.dtype):
    """Parameters created inside are allocated directly on `device` in `dtype` (no CPU detour)."""
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            yield
    finally:
        torch.set_default_dtype(old)


def iterate_safetensors(model_dir: str | os.PathLike) -> Iterator[tuple[str, object]]:
    """(name, lazy slice) for every tensor, one file open at a time."""
    from safetensors import safe_open

    for path in safetensors_files(model_dir):
        with safe_open(path, framework="pt", device="cpu") as f:
            for name in f.keys():
                yield name, f.get_slice(name)


def load_weights(model: nn.Module, weights: Iterable[tuple[str, object]]) -> None:
    """Route each checkpoint tensor to its parameter's weight_loader (fusing q/k/v and gate/up)."""
    params = dict(model.named_parameters())
    stacked = getattr(model, "stacked_params", [])
    tied = getattr(model.config, "tie_word_embeddings", False) and "lm_head.weight" not in params
    loaded: set[str] = set()
    for name, w in weights:
        if "rotary_emb.inv_freq" in name or (tied and name == "lm_head.weight"):
            continue
        shard = None
        for fused, ckpt, shard_id in stacked:
            if f".{ckpt}." in name:
                name, shard = name.replace(f".{ckpt}.", f".{fused}."), shard_id
                break
        param = params.get(name)
        if param is None:
            if name == "lm_head.weight":  # tied: the checkpoint repeats the embedding
                continue
            logger.warning("checkpoint tensor %s has no matching parameter; skipped", name)
            continue
        loader = getattr(param, "weight_loader", default_weight_loader)
        try:
            loader(param, w, shard) if shard is not None else loader(param, w)
        except ValueError as e:
            raise ValueError(f"loading {name}: {e}") from None
        loaded.add(name)
    missing = sorted(set(params) - loaded)
    if missing:
        raise ValueError(f"checkpoint is missing {len(missing)} parameter(s), e.g. {missing[:5]}")


@torch.no_grad()
def init_dummy_weights(model: nn.Module, seed: int = 0, std: float = 0.02) -> None:
    """Deterministic random weights on the parameters' own device: matrices ~ N(0, std),
    norm scales 1, biases 0 — so activations stay finite through any depth."""
    gen = None
    for name, p in model.named_parameters():
        if gen is None:
            gen = torch.Generator(device=p.device).manual_seed(seed)
        if p.dim() >= 2:
            p.normal_(0.0, std, generator=gen)
        elif name.endswith("norm.weight"):
            p.fill_(1.0)
        else:
            p.zero_()


def get_model(hf_config, *, model_dir: str | os.PathLike | None, device: torch.device, dtype: torch.dtype,
              load_format: str = "auto", seed: int = 0, tp_rank: int = 0, tp_size: int = 1) -> nn.Module:
    """Instantiate config.architectures[0] on `device` in `dtype` and fill its weights."""
    if load_format not in ("auto", "safetensors", "dummy"):
        raise ValueError(f"load_format must be auto, safetensors or dummy, got {load_format!r}")
    cls = get_model_class(hf_config)
    files = None
    if load_format != "dummy":
        if model_dir is None:
            raise ValueError("model: a directory is required unless load_format='dummy'")
        files = safetensors_files(model_dir)  # fail before allocating anything
    device = torch.device(device)
    with _building_on(device, dtype):
        model = cls(hf_config, tp_rank=tp_rank, tp_size=tp_size)
    model.to(device)  # buffers made on CPU (rotary inv_freq) follow the parameters
    if files is None:
        init_dummy_weights(model, seed)
    else:
        load_weights(model, iterate_safetensors(model_dir))
    return model.eval()
