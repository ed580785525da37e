"""Measured ceilings of the device, taken in the same run as a benchmark (docs/benchmarks.md)."""
from __future__ import annotations

import datetime
import json
import os
import subprocess
from pathlib import Path

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


def device_name() -> str:
    return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"


def git_commit() -> str:
    """The commit that produced a result; PAGEDSERVE_COMMIT names it where the tree has no .git
    (the GPU machine receives a plain copy of the working tree)."""
    if os.environ.get("PAGEDSERVE_COMMIT"):
        return os.environ["PAGEDSERVE_COMMIT"]
    try:
        return subprocess.check_output(["git", "rev-parse", "HEAD"], text=True, stderr=subprocess.DEVNULL).strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def write_result(path: str | Path, name: str, command: str, config: dict, results: dict,
                 baselines: dict, ratios: dict, table_md: str | None = None) -> dict:
    """docs/benchmarks.md's result format, plus a short markdown table beside the JSON."""
    doc = {"benchmark": name, "device": device_name(), "commit": git_commit(),
           "date": datetime.date.today().isoformat(), "command": command, "config": config,
           "results": results, "baselines": baselines, "ratios": ratios}
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=2) + "\n")
    md = table_md or "\n".join(
        [f"# {name}", "", f"`{command}`", "", "| key | value |", "|---|---|"]
        + [f"| {k} | {v} |" for k, v in {**results, **{f'ratio.{k}': v for k, v in ratios.items()}}.items()
           if not isinstance(v, (list, dict))])
    path.with_suffix(".md").write_text(md + "\n")
    return doc
