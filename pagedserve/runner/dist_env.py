"""Where this process stands among the tensor-parallel ranks. Torch-free: the CLI imports it.

Ranks come either from `LLM(tensor_parallel_size=N)` (rank 0 starts the others on loopback,
setting the same variables) or from torchrun's standard env:// variables (every rank
started externally, possibly on other machines): MASTER_ADDR, MASTER_PORT, WORLD_SIZE,
RANK, LOCAL_RANK.
"""
from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from datetime import timedelta

# Idle workers wait in the control group for the next command: effectively forever.
CONTROL_TIMEOUT = timedelta(days=30)


def compute_timeout() -> timedelta:
    """Longest a collective inside a step waits for a peer (PAGEDSERVE_TP_TIMEOUT seconds)."""
    return timedelta(seconds=float(os.environ.get("PAGEDSERVE_TP_TIMEOUT", "600")))


START_TIMEOUT_ENV = "PAGEDSERVE_TP_START_TIMEOUT"


def start_timeout() -> timedelta:
    """Longest rank 0 waits for every rank to arrive (PAGEDSERVE_TP_START_TIMEOUT seconds)."""
    return timedelta(seconds=float(os.environ.get(START_TIMEOUT_ENV, "600")))


PHASE_TIMEOUT_ENV = "PAGEDSERVE_TP_PHASE_TIMEOUT"
STEP_TIMEOUT_ENV = "PAGEDSERVE_TP_STEP_TIMEOUT"


def env_positive(name: str, default: float, unit: str) -> float:
    """A positive number from the environment variable `name` (default when unset or empty);
    ValueError names the variable and the unit."""
    raw = os.environ.get(name, "")
    if not raw:
        return default
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"{name} must be a number of {unit}, got {raw!r}") from None
    if value <= 0:
        raise ValueError(f"{name} must be > 0 {unit}, got {raw!r}")
    return value


def _seconds(name: str, default: float) -> float:
    return env_positive(name, default, "seconds")


def phase_timeout() -> float:
    """Longest one start-up phase (load, profile, KV allocation, swap measurement, graph capture)
    may take on any rank before the engine fails naming the rank and the phase
    (PAGEDSERVE_TP_PHASE_TIMEOUT seconds, default 900: a cold read of a large checkpoint)."""
    return _seconds(PHASE_TIMEOUT_ENV, 900.0)


def step_timeout() -> float:
    """Longest one step may take, from rank 0's broadcast to its logits being ready, before the
    engine fails naming the lagging rank (PAGEDSERVE_TP_STEP_TIMEOUT seconds, default 300: the
    first steps compile kernels)."""
    return _seconds(STEP_TIMEOUT_ENV, 300.0)


@dataclass
class DistEnv:
    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int
    external: bool  # started by torchrun (or another launcher), not spawned by rank 0


def torchrun_env() -> DistEnv | None:
    """The env:// rendezvous as torchrun sets it, or None when this process was not launched so."""
    need = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    if not all(k in os.environ for k in need):
        return None
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if world < 2:
        return None
    if not 0 <= rank < world:
        raise ValueError(f"RANK must be in [0, WORLD_SIZE={world}), got {rank}")
    return DistEnv(rank=rank, world_size=world, local_rank=int(os.environ.get("LOCAL_RANK", rank)),
                   master_addr=os.environ["MASTER_ADDR"], master_port=int(os.environ["MASTER_PORT"]),
                   external=True)


def is_external_worker() -> bool:
    """True in a torchrun-launched process of rank > 0: it serves rank 0 instead of running an engine."""
    env = torchrun_env()
    return env is not None and env.rank > 0


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


