"""Which implementation of the fused layer ops a device gets: the Triton kernels
(pagedserve.layers.triton_fused, imported lazily) on CUDA, plain torch elsewhere.

PAGEDSERVE_FUSED=0 forces plain torch on CUDA (for A/B runs); PAGEDSERVE_FUSED=force uses the
Triton kernels on any device, which on CPU only works under TRITON_INTERPRET=1 (the tests).
The choice is cached per device type; reset() forgets it after the variable changes.
"""
from __future__ import annotations

import importlib
import logging
import os
from types import ModuleType

import torch

logger = logging.getLogger(__name__)
_CHOICE: dict[str, ModuleType | None] = {}


def fused_ops(device: torch.device) -> ModuleType | None:
    """The Triton module for tensors on `device`, or None for the plain-torch path."""
    kind = device.type
    if kind not in _CHOICE:
        mode = os.environ.get("PAGEDSERVE_FUSED", "1").strip().lower()
        mod = None
        if mode == "force" or (kind == "cuda" and mode not in ("0", "false", "off")):
            try:
                mod = importlib.import_module("pagedserve.layers.triton_fused")
            except ImportError as e:
                logger.warning("Triton fused layer ops unavailable (%s); using plain torch", e)
        _CHOICE[kind] = mod
    return _CHOICE[kind]


def reset() -> None:
    _CHOICE.clear()


def choices() -> dict[str, str]:
    """What each device type got so far in this process: "triton" or "torch" (for result files)."""
    return {kind: "torch" if mod is None else "triton" for kind, mod in _CHOICE.items()}
