"""Block sizes of the Triton W8A8 GEMM (triton_fp8_gemm.py): a tuned table per weight shape, as JSON
files in configs/ beside this module, or heuristics where there is none.

A file configs/N=<out features>,K=<in features>,device=<name>.json (device as
tuned_tables.device_name names it, e.g. NVIDIA_H200) maps a token-count bucket M (as a string: "1", "2", "4", ... "64",
"128", ...) to {BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, SPLIT_K, num_warps, num_stages}, and, where the
tuner timed them, "triton_us" and "cublas_us" (microseconds at that M, weights read from HBM) and
"timing" ("graph": per launch of a replayed CUDA graph, as decode runs; "launch": do_bench, one
call at a time; absent in tables tuned before the tuner timed graphs). Only KEYS and the two times
are read.
benchmarks/kernels/tune_fp8_gemm.py writes them on the GPU. A call with m tokens takes the entry of
the smallest bucket >= m; beyond the table's largest bucket (a tuning run stopped early) the
heuristics decide, as they do for a shape without a table. Block sizes decide speed only, never
the result beyond float32 summation order, so any entry is correct for any m.

Every choice here is a host-side function of shapes only (no device reads), so a CUDA graph
captures whatever it picks, and the runner's warm-up (fp8_gemm_warmup.py) can run every config
that serving will meet: warmup_token_counts lists one m per bucket.
"""
from __future__ import annotations

import functools
import logging
from pathlib import Path

import torch

from pagedserve.layers.tuned_tables import device_name, read_table

logger = logging.getLogger(__name__)
CONFIG_DIR = Path(__file__).with_name("configs")
KEYS = ("BLOCK_M", "BLOCK_N", "BLOCK_K", "GROUP_M", "SPLIT_K", "num_warps", "num_stages")
# The heuristics' buckets; a tuned table has its own (its keys).
DEFAULT_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)
# Without a tuned table, `auto` runs Triton up to this many tokens: the H200 A/B at 52fbedc
# (unsplit kernel) had it ahead of cuBLASLt at M <= 64 for three of Llama-3.1-8B's four shapes.
AUTO_MAX_M = 64


def config_file_name(n: int, k: int, device: str) -> str:
    return f"N={n},K={k},device={device}.json"


@functools.lru_cache(maxsize=None)
def load_table(name: str) -> dict[int, dict] | None:
    """bucket -> entry (KEYS as ints, plus the timings where present); None without a file."""
    table = read_table(CONFIG_DIR / name, KEYS, ("triton_us", "cublas_us"))
    if table is not None:
        logger.info("FP8 GEMM block sizes from %s (%d buckets)", name, len(table))
    return table


def bucket_of(m: int, buckets) -> int | None:
    """The smallest bucket >= m; None beyond the largest."""
    return min((b for b in buckets if b >= m), default=None)


@functools.lru_cache(maxsize=None)
def _num_sms(device: str) -> int:
    if device == "cpu":
        return 132  # the interpreter: pretend an H100/H200, so the tests meet split-K
    return torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count


def default_config(m: int, n: int, k: int, num_sms: int = 132) -> dict:
    """Untuned. Up to 64 tokens the GEMM streams its weight once: narrow row blocks, and the K
    loop split until the tiles fill the SMs about twice over (down_proj's N=4096 in 64-wide
    blocks is 64 tiles on 132 SMs), keeping >= 4 K steps per split. Beyond, square tiles."""
    if m > 64:
        if m <= 256:
            return dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=128, GROUP_M=8, SPLIT_K=1, num_warps=4, num_stages=3)
        return dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=128, GROUP_M=8, SPLIT_K=1, num_warps=8, num_stages=3)
    block_m = 16 if m <= 16 else 32 if m <= 32 else 64
    tiles = -(-m // block_m) * -(-n // 64)
    k_steps = -(-k // 128)
    split = 1
    while split < 8 and tiles * split < 2 * num_sms and k_steps // (2 * split) >= 4:
        split *= 2
    return dict(BLOCK_M=block_m, BLOCK_N=64, BLOCK_K=128, GROUP_M=1, SPLIT_K=split, num_warps=4, num_stages=4)


def get_config(m: int, n: int, k: int, device: torch.device) -> dict:
    """The config for m tokens against an [n, k] weight on `device`."""
    return dict(_get_config(m, n, k, device_name(device)))


@functools.lru_cache(maxsize=8192)
def _get_config(m: int, n: int, k: int, device: str) -> dict:
    table = load_table(config_file_name(n, k, device)) or {}
    bucket = bucket_of(m, table)
    if bucket is not None:
        return {key: table[bucket][key] for key in KEYS}
    return default_config(bucket_of(m, DEFAULT_BUCKETS) or m, n, k, _num_sms(device))


def triton_wins(m: int, n: int, k: int, device: torch.device) -> bool:
    """`auto`'s choice: the tuned table's measurement at m's bucket where it has one (Triton
    strictly faster than cuBLASLt), else m <= AUTO_MAX_M."""
    return _triton_wins(m, n, k, device_name(device))


@functools.lru_cache(maxsize=8192)
def _triton_wins(m: int, n: int, k: int, device: str) -> bool:
    table = load_table(config_file_name(n, k, device)) or {}
    entry = table.get(bucket_of(m, table))
    if entry is not None and "triton_us" in entry and "cublas_us" in entry:
        return entry["triton_us"] < entry["cublas_us"]
    return m <= AUTO_MAX_M


def warmup_token_counts(n: int, k: int, device: torch.device, max_tokens: int) -> list[int]:
    """One token count per bucket up to max_tokens (its largest m, and max_tokens itself), so the
    warm-up compiles every config serving can pick; 1 too (the decode of one sequence)."""
    table = load_table(config_file_name(n, k, device_name(device))) or {}
    beyond = [b for b in DEFAULT_BUCKETS if b > max(table, default=0)]  # the heuristics' share
    counts = {1, max_tokens} | {b for b in [*table, *beyond] if b <= max_tokens}
    # A bucket that starts below max_tokens but ends beyond it is served by max_tokens (in counts).
    return sorted(counts)
