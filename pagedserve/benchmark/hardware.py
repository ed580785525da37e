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


def copy_buffer_bytes(free_bytes: int, most: int = 4 << 30, least: int = 256 << 20) -> int:
    """The copy test's buffer size: 4 GiB, or a third of what the device has free beside an
    engine that took its share (an 80 GB card at --gpu-memory-utilization 0.9 has ~4 GiB left,
    not the 8 GiB two buffers need); each of the two buffers takes it. Buffers of a GiB still run
    near the peak (the H100's 1.2 GiB: 2.95-3.00 TB/s of its 3.35, 50th session)."""
    return max(least, min(most, free_bytes // 3)) // 4096 * 4096


def measure_copy_bandwidth(nbytes: int | None = None) -> float:
    """Device-to-device copy, counting bytes read plus written (bytes/s)."""
    if nbytes is None:
        nbytes = copy_buffer_bytes(torch.cuda.mem_get_info()[0])
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


def measure_fp8_matmul_rate(n: int = 8192) -> float:
    """Dense e4m3 x e4m3 -> bf16 matmul through torch._scaled_mm (cuBLASLt), the GEMM FP8 weights
    run (FLOP/s); on the H200 about twice the bf16 rate."""
    a = torch.randn(n, n, device="cuda").to(torch.float8_e4m3fn)
    b = torch.randn(n, n, device="cuda").to(torch.float8_e4m3fn).t()  # column-major, as cuBLASLt wants
    one = torch.ones((), dtype=torch.float32, device="cuda")
    t = _time_cuda(lambda: torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.bfloat16), 10)
    return 2 * n ** 3 / t
