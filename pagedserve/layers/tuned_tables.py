"""Tuned block-size tables of the Triton kernels, shared by the fused MoE layer
(fused_moe/config.py) and the FP8 GEMM (quant/fp8_gemm_config.py): one JSON file per shape and
device, mapping a token count (as a string) to the launch's integer settings. Their tuners
(benchmarks/kernels/tune_*.py) write the files on the GPU; a shape without one takes its module's
heuristics, which are correct for every shape (block sizes only decide speed). An entry may carry
more (the tuners record their times and how they were taken): the readers take only their keys."""
from __future__ import annotations

import functools
import json
from pathlib import Path

import torch


def device_name(device: torch.device) -> str:
    """"NVIDIA_H200" and the like (spaces and dashes to underscores); "cpu" off CUDA."""
    device = torch.device(device)
    if device.type != "cuda":
        return "cpu"
    return _cuda_name(device.index if device.index is not None else torch.cuda.current_device())


@functools.lru_cache(maxsize=None)
def _cuda_name(index: int) -> str:
    return torch.cuda.get_device_name(index).replace(" ", "_").replace("-", "_")


def read_table(path: Path, keys: tuple[str, ...], float_keys: tuple[str, ...] = ()) -> dict[int, dict] | None:
    """token count -> entry: `keys` as ints (each required: a missing one is an error naming the
    file and the entry), `float_keys` as floats where present; None when there is no file."""
    if not path.is_file():
        return None
    with open(path) as f:
        raw = json.load(f)
    table = {}
    for tokens, entry in raw.items():
        missing = [k for k in keys if k not in entry]
        if missing:
            raise ValueError(f"{path}: entry {tokens!r} lacks {missing}")
        table[int(tokens)] = {**{k: int(entry[k]) for k in keys},
                              **{k: float(entry[k]) for k in float_keys if k in entry}}
    return table


def write_table(path: Path | str, table: dict[str, dict]) -> None:
    """The tuners' writer: entries in token-count order, one key a line (diffs stay readable)."""
    with open(path, "w") as f:
        json.dump(dict(sorted(table.items(), key=lambda kv: int(kv[0]))), f, indent=2)
        f.write("\n")
