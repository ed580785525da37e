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
