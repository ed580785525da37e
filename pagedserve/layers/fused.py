"""Which implementation of the fused layer ops and of the plain sampling path a device gets: the
Triton kernels (pagedserve.layers.triton_fused, .triton_sampling, imported lazily) on CUDA, plain
torch elsewhere.

PAGEDSERVE_FUSED (layer ops), PAGEDSERVE_FUSED_SAMPLING (sampler.sample_plain_device) and
PAGEDSERVE_FUSED_MOE (routing and grouped GEMMs of layers/fused_moe): "0"
forces plain torch on CUDA (for A/B runs); "force" uses the Triton kernels on any device, which
on CPU only works under TRITON_INTERPRET=1 (the tests). Each choice is cached per device type;
reset() forgets them after a variable changes.
"""
from __future__ import annotations

import importlib
import logging
import os
from types import ModuleType

import torch

logger = logging.getLogger(__name__)
_CHOICE: dict[str, ModuleType | None] = {}
_SAMPLING_CHOICE: dict[str, ModuleType | None] = {}
_MOE_CHOICE: dict[str, ModuleType | None] = {}


def _choose(cache: dict, env: str, module: str, what: str, device: torch.device) -> ModuleType | None:
    kind = device.type
    if kind not in cache:
        mode = os.environ.get(env, "1").strip().lower()
        mod = None
        if mode == "force" or (kind == "cuda" and mode not in ("0", "false", "off")):
            try:
                mod = importlib.import_module(module)
            except ImportError as e:
                logger.warning("Triton %s unavailable (%s); using plain torch", what, e)
        cache[kind] = mod
    return cache[kind]


def fused_ops(device: torch.device) -> ModuleType | None:
    """The Triton layer-op module for tensors on `device`, or None for the plain-torch path."""
    return _choose(_CHOICE, "PAGEDSERVE_FUSED", "pagedserve.layers.triton_fused", "fused layer ops", device)


def fused_sampling(device: torch.device) -> ModuleType | None:
    """The Triton sampling module (triton_sampling.py) for logits on `device`, or None for torch."""
    return _choose(_SAMPLING_CHOICE, "PAGEDSERVE_FUSED_SAMPLING", "pagedserve.layers.triton_sampling",
                   "sampling kernels", device)


def fused_moe_ops(device: torch.device) -> ModuleType | None:
    """The Triton MoE module (fused_moe/triton_moe.py) for tensors on `device`, or None for torch."""
    return _choose(_MOE_CHOICE, "PAGEDSERVE_FUSED_MOE", "pagedserve.layers.fused_moe.triton_moe",
                   "fused MoE kernels", device)


def reset() -> None:
    _CHOICE.clear()
    _SAMPLING_CHOICE.clear()
    _MOE_CHOICE.clear()


def choices(sampling: bool = False, moe: bool = False) -> dict[str, str]:
    """What each device type got so far in this process, for the layer ops (or, sampling=True,
    the plain sampling path; moe=True, the MoE kernels): "triton" or "torch" (for result files)."""
    cache = _SAMPLING_CHOICE if sampling else _MOE_CHOICE if moe else _CHOICE
    return {kind: "torch" if mod is None else "triton" for kind, mod in cache.items()}
