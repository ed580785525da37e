"""Kernel-launch arithmetic on the host, in plain Python ints.

Triton 3.6 makes `triton.cdiv` and `triton.next_power_of_2` constexpr functions: called from host
code, each first unwraps every argument as a possible constexpr, ~2 us a call on our CI CPU against
~0.1 us for the same arithmetic on ints. An eager attention layer (write_kv, the decode and
prefill launches) made 11 such calls: about a third of its wrappers' host time, paid by every
layer of every step that runs attention outside a graph (piecewise graphs run it eagerly between
their pieces). Kernels keep `tl.cdiv` / `triton.next_power_of_2`; these are for launch code only.
"""
from __future__ import annotations


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for positive b (triton.cdiv's value)."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """The smallest power of two >= n; 0 for n <= 0 (triton.next_power_of_2's values)."""
    return 1 << (n - 1).bit_length() if n > 0 else 0


def stride_unit(*strides: int) -> int:
    """The unit a kernel's unspecialized strides go in: 16 where every one is a multiple of 16,
    else 1. Triton specializes no argument listed in do_not_specialize (so one compile serves every
    batch), and then cannot prove a row aligned: it moves bf16 rows 2 bytes an access (PTX
    ld.global.b16). Strides handed over in sixteens and multiplied back by a constexpr carry the
    alignment, and the rows move 16 bytes an access (ld.global.v4.b32). Where that pays (one H100):
    the long-prefill merge (1.8 -> 2.8 TB/s, 60th session) and the sampling span kernel (0.75-0.83x
    the time, 61st); not for the attention kernels' query tiles and outputs, which took 0.99-1.10x
    their time so (61st, docs/benchmarks-history.md). Given one model's tensors every call picks the
    same unit, so serving meets the warm-up's compiled variant."""
    return 16 if all(s % 16 == 0 for s in strides) else 1
