"""Measured ceilings of the device, taken in the same run as a benchmark (docs/benchmarks.md)."""
from __future__ import annotations

import torch


def _time_cuda(fn, iters: int) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    fn()
    torch.cuda.synchronize()
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3 / iters


def measure_copy_bandwidth(nbytes: int = 4 << 30) -> float:
    """Device-to-device copy, counting bytes read plus written (bytes/s)."""
    a = torch.empty(nbytes // 2, dtype=torch.bfloat16, device="cuda")
    b = torch.empty_like(a)
    t = _time_cuda(lambda: b.copy_(a), 10)
    return 2 * nbytes / t


def measure_matmul_rate(n: int = 8192) -> float:
    """Dense bf16 matmul on random data (FLOP/s)."""
    a = torch.randn(n, n, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(n, n, dtype=torch.bfloat16, device="cuda")
    t = _time_cuda(lambda: a @ b, 10)
    return 2 * n ** 3 / t
