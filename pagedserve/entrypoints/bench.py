"""`pagedserve bench`: entry points of the benchmark subcommands (implementations live apart)."""
from __future__ import annotations

from typing import Any


def run_serve_cli(args: Any) -> int:
    from pagedserve.entrypoints.bench_serve import run_serve_cli as run
    return run(args)


def run_throughput_cli(args: Any) -> int:
    raise NotImplementedError("pagedserve bench throughput is not implemented yet")
