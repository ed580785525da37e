"""Block sizes of the grouped GEMM: a tuned table per shape, as JSON files beside this module.

A file configs/E=<experts>,H=<hidden>,I=<intermediate per rank>,dtype=<dtype>,device=<name>.json
(dtype: the experts' weights, bfloat16 / float16 / float32, or fp8_w8a8 for FP8 experts)
maps a token count (as a string) to {BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, num_warps, num_stages}.
benchmarks/kernels/tune_fused_moe.py writes them on the GPU. A call with T tokens takes the entry
whose token count is nearest T; a shape with no file takes default_config, which is correct for
every shape (block sizes only decide speed) and vLLM's own fallback in spirit: small row blocks
while experts get few rows each, larger ones beyond.
"""
from __future__ import annotations

import functools
import logging
from pathlib import Path

import torch

from pagedserve.layers.tuned_tables import device_name, read_table

logger = logging.getLogger(__name__)
CONFIG_DIR = Path(__file__).with_name("configs")
KEYS = ("BLOCK_M", "BLOCK_N", "BLOCK_K", "GROUP_M", "num_warps", "num_stages")
# The experts' dtype names the file (vLLM's names); fp8 experts take W8A8 GEMMs, whatever the activations.
_DTYPE_NAMES = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32",
                torch.float8_e4m3fn: "fp8_w8a8"}


def config_file_name(num_experts: int, hidden: int, intermediate: int, dtype: torch.dtype, device: str) -> str:
    return f"E={num_experts},H={hidden},I={intermediate},dtype={_DTYPE_NAMES[dtype]},device={device}.json"


@functools.lru_cache(maxsize=None)
def load_table(name: str) -> dict[int, dict] | None:
    table = read_table(CONFIG_DIR / name, KEYS)
    if table is not None:
        logger.info("fused MoE block sizes from %s (%d token counts)", name, len(table))
    return table


def default_config(num_tokens: int, num_experts: int, top_k: int) -> dict:
    if num_tokens * top_k <= num_experts * 4:  # a handful of rows per expert: decode
        return dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=64, GROUP_M=1, num_warps=4, num_stages=3)
    return dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=32, GROUP_M=8, num_warps=4, num_stages=3)


def get_config(num_tokens: int, num_experts: int, hidden: int, intermediate: int, top_k: int,
               dtype: torch.dtype, device: torch.device) -> dict:
    """The block sizes for a call with num_tokens tokens (a host-side choice from shapes only)."""
    return dict(_get_config(num_tokens, num_experts, hidden, intermediate, top_k, dtype, device_name(device)))


@functools.lru_cache(maxsize=4096)
def _get_config(num_tokens, num_experts, hidden, intermediate, top_k, dtype, device: str) -> dict:
    table = load_table(config_file_name(num_experts, hidden, intermediate, dtype, device))
    if not table:
        return default_config(num_tokens, num_experts, top_k)
    nearest = min(table, key=lambda m: (abs(m - num_tokens), m))
    return table[nearest]
