"""Counting host reads of tensors without timing: what a device-to-host transfer is on CUDA.

count_reads() patches the torch.Tensor methods that read a tensor's values on the host (tolist,
item, cpu, numpy, and bool/int/float/index conversions) and counts the calls made from the given
modules' own code (the caller's frame), so a CPU run shows where a CUDA run would sync. Reads
inside other code (the CPU attention reads its host lengths) are not counted: the CUDA test
(torch.cuda.set_sync_debug_mode) covers those.
"""
from __future__ import annotations

import sys
from collections import Counter
from contextlib import contextmanager

import torch

READS = ("tolist", "item", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__")


@contextmanager
def count_reads(prefixes: tuple[str, ...]):
    """Yields a Counter of (module, method) -> calls made from modules whose name starts with a prefix."""
    counts: Counter = Counter()
    originals = {name: getattr(torch.Tensor, name) for name in READS}

    def wrap(name, fn):
        def counted(self, *a, **kw):
            module = sys._getframe(1).f_globals.get("__name__", "")
            if module.startswith(prefixes):
                counts[module, name] += 1
            return fn(self, *a, **kw)
        return counted

    for name, fn in originals.items():
        setattr(torch.Tensor, name, wrap(name, fn))
    try:
        yield counts
    finally:
        for name, fn in originals.items():
            setattr(torch.Tensor, name, fn)
