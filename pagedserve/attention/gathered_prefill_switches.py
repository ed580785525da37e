"""The gathered long-prefill path's switches: the environment variables gathered_prefill.configure
reads at start-up, and what each value selects. LONG_PREFILL_ENV turns the path on or off
(enabled: unset, on for Hopper GPUs); FIRST_CHUNK_ENV, SQUARE_ENV, PREFIX_ENV, TAIL_ENV and
GATHER_ENV choose how it runs; MERGE_ENV and FOLD_ENV choose a Triton kernel or torch ops for two
of its steps. A value a switch does not know is an error that names the switch.
"""
from __future__ import annotations

import importlib
import os

import torch

from pagedserve.attention import gathered_prefill_plan as plan

LONG_PREFILL_ENV = "PAGEDSERVE_LONG_PREFILL"
MERGE_ENV = "PAGEDSERVE_LONG_PREFILL_MERGE"  # 'triton' (default) or 'torch': how the parts are merged
FOLD_ENV = "PAGEDSERVE_LONG_PREFILL_FOLD"  # 'triton' (default) or 'torch': how the queries are folded
# N > 0: a chunk of at least N tokens after fewer than PREFIX_BUCKET (a prompt's first chunk, or one
# after a short cached prefix) takes the path too: its square on cuDNN's causal kernel (on the H200
# 0.88 against our prefill kernel's 1.42 ms a layer at 8192 x 8192, runs/s27_long_prefill/), the few
# earlier tokens on flash. 0: off.
FIRST_CHUNK_ENV = "PAGEDSERVE_LONG_PREFILL_FIRST"
FIRST_CHUNK_DEFAULT = 4096
# How the chunk's square meets cuDNN: 'gqa' (the default) hands it the KV heads as they are (cuDNN
# reads a KV head for each of its group's query heads); 'repeat' copies them once per query head
# first, as until the 36th session (two [c, H, D] copies a layer: ~118 ms of a 100k prefill's
# 7.3 s in runs/s33_prefill_profile/).
SQUARE_ENV = "PAGEDSERVE_LONG_PREFILL_SQUARE"
# Where the prefix's tail past its bucketed head goes when it is a whole number of TAIL_STEP
# tokens: 'cudnn' (the default since the 38th session: chunks sized by cost beside decodes leave
# such tails on most chunks) or 'flash' (as before: torch's flash kernel, no plans).
TAIL_ENV = "PAGEDSERVE_LONG_PREFILL_TAIL"
# How the prefix parts meet cuDNN: 'gqa' (the default since the 59th session) hands cuDNN the queries
# as they lie in the model's qkv, [H, rows, D] at its row stride (a padded copy for a chunk short of
# its bucket), and cuDNN serves the KV groups itself, as for the square; 'folded' folds each KV
# group's query heads into the query length first (one Triton pass, triton_fold: ~17.5 ms of a 100k
# prefill's 6.8 s on the H100), as until then. Offline on the H100 (runs/s59_h100/), two rounds each:
# 32k prefills 1.224 / 1.222 s against 1.233 / 1.246 folded, 100k within 0.7% either way.
PREFIX_ENV = "PAGEDSERVE_LONG_PREFILL_PREFIX"
# 'runs' (the default): a chunk whose pages lie in one run of the pool reads them in place;
# 'always': every chunk's context is gathered first, as until the 52nd session.
GATHER_ENV = "PAGEDSERVE_LONG_PREFILL_GATHER"


def first_chunk_tokens() -> int:
    """FIRST_CHUNK_ENV's value (FIRST_CHUNK_DEFAULT unset): 0 (off) or the fewest tokens a first
    chunk needs."""
    value = os.environ.get(FIRST_CHUNK_ENV, "").strip() or str(FIRST_CHUNK_DEFAULT)
    # Below MIN_CHUNK a short chunk would be padded to a whole query bucket for cuDNN.
    if not value.isdigit() or 0 < int(value) < plan.MIN_CHUNK:
        raise ValueError(f"{FIRST_CHUNK_ENV}={value!r}: expected 0 (off) or a whole number of tokens "
                         f">= {plan.MIN_CHUNK}")
    return int(value)


def square_gqa() -> bool:
    """SQUARE_ENV's choice: True for 'gqa' (the default), False for 'repeat'."""
    value = os.environ.get(SQUARE_ENV, "").strip() or "gqa"
    if value not in ("gqa", "repeat"):
        raise ValueError(f"{SQUARE_ENV}={value!r}: expected 'gqa' (the default) or 'repeat'")
    return value == "gqa"


def prefix_gqa() -> bool:
    """PREFIX_ENV's choice: True for 'gqa' (the default), False for 'folded'."""
    value = os.environ.get(PREFIX_ENV, "").strip() or "gqa"
    if value not in ("gqa", "folded"):
        raise ValueError(f"{PREFIX_ENV}={value!r}: expected 'gqa' (the default) or 'folded'")
    return value == "gqa"


def tail_on_cudnn() -> bool:
    """TAIL_ENV's choice: True for 'cudnn' (the default), False for 'flash'."""
    value = os.environ.get(TAIL_ENV, "").strip() or "cudnn"
    if value not in ("cudnn", "flash"):
        raise ValueError(f"{TAIL_ENV}={value!r}: expected 'cudnn' (the default) or 'flash'")
    return value == "cudnn"


def pages_in_place() -> bool:
    """GATHER_ENV's choice: True for 'runs' (the default), False for 'always'."""
    value = os.environ.get(GATHER_ENV, "").strip() or "runs"
    if value not in ("runs", "always"):
        raise ValueError(f"{GATHER_ENV}={value!r}: expected 'runs' (the default) or 'always'")
    return value == "runs"


def _triton_kernel(env: str, module: str, name: str):
    """A two-way switch between one of this path's Triton kernels and torch ops: 'triton' (or
    unset) gives the kernel, pagedserve.attention.<module>.<name>; 'torch' gives None."""
    value = os.environ.get(env, "").strip() or "triton"
    if value not in ("torch", "triton"):
        raise ValueError(f"{env}={value!r}: expected 'triton' (the default) or 'torch'")
    return getattr(importlib.import_module(f"pagedserve.attention.{module}"), name) if value == "triton" else None


def merge_kernel():
    """MERGE_ENV's merge: triton_merge.merge_into (the default) or None (torch ops)."""
    return _triton_kernel(MERGE_ENV, "triton_merge", "merge_into")


def fold_kernel():
    """FOLD_ENV's fold: triton_fold.fold_into (the default) or None (a permuted copy and a fill)."""
    return _triton_kernel(FOLD_ENV, "triton_fold", "fold_into")


def enabled(device: torch.device) -> bool:
    """The switch on `device`: unset (or 'auto'): on for Hopper GPUs (sm90), where it was measured
    (a 100k prefill 8.59 -> 7.64 s on the H200, docs/long-context.md), off elsewhere; 'cudnn': on
    for any CUDA GPU; 'off' or '0': off."""
    value = os.environ.get(LONG_PREFILL_ENV, "").strip()
    if value not in ("", "auto", "off", "0", "cudnn"):
        raise ValueError(f"{LONG_PREFILL_ENV}={value!r}: expected 'cudnn', 'off' (or '0'), or unset "
                         "('auto': on for Hopper GPUs)")
    if value in ("", "auto"):
        return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] == 9
    return value == "cudnn" and device.type == "cuda"
