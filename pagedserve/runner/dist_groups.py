"""Process groups for tensor parallelism: one rendezvous, two groups.

Every rank joins the same TCPStore (hosted by rank 0) and two process groups:

- the control group (gloo, CPU, very long timeout) carries rank 0's commands and the
  small per-step plan. Workers sit in it between steps, so it must tolerate an idle
  server; a dead peer still fails it at once (gloo sees the socket close).
- the compute group (NCCL on GPUs, gloo on CPU) carries the model's all-reduces and
  all-gathers, with a bounded timeout, so a rank that hangs mid-step surfaces as an error.

The store doubles as the error channel: a worker that fails writes its traceback under
`error/<rank>` before exiting, and rank 0 reads it to name the rank and the cause.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from pagedserve.runner.dist_env import CONTROL_TIMEOUT, DistEnv, compute_timeout, start_timeout


@dataclass
class DistGroups:
    env: DistEnv
    store: dist.Store
    control: object        # gloo ProcessGroup (the default group)
    compute: object = None  # NCCL or gloo ProcessGroup for the model's collectives (set by init_compute)
    device: torch.device | None = None


def compute_device(env: DistEnv, device: str) -> torch.device:
    """cuda:<local_rank> when this rank computes on a GPU, else cpu."""
    kind = device if device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    if kind.startswith("cuda"):
        return torch.device("cuda", env.local_rank)
    return torch.device(kind)


def joined_key(rank: int) -> str:
    return f"joined/{rank}"


def init_control(env: DistEnv, check_alive=None) -> DistGroups:
    """Join the rendezvous and the control group (blocks until every rank has arrived).

    Rank 0 first waits for every rank's `joined` key in the store, calling check_alive()
    between polls, so a worker that dies while starting fails the start-up at once instead
    of leaving rank 0 inside gloo's connect for the control group's whole timeout.
    """
    if dist.is_initialized():
        raise RuntimeError("torch.distributed is already initialized in this process: "
                           "one tensor-parallel engine per process")
    timeout = start_timeout()
    # Under torchrun the agent of node 0 already hosts a store at MASTER_PORT: every rank is a client.
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    tcp = dist.TCPStore(env.master_addr, env.master_port, env.world_size,
                        is_master=env.rank == 0 and not agent_store, timeout=timeout, wait_for_workers=False)
    store = dist.PrefixStore("pagedserve", tcp)  # the agent's store is shared with torchrun itself
    if env.rank == 0:
        deadline = time.monotonic() + timeout.total_seconds()
        missing = list(range(1, env.world_size))
        while missing:
            if check_alive is not None:
                check_alive()
            missing = [r for r in missing if not store.check([joined_key(r)])]
            if missing and time.monotonic() > deadline:
                raise TimeoutError(f"tensor-parallel ranks {missing} did not join {env.master_addr}:"
                                   f"{env.master_port} within {timeout.total_seconds():.0f} s")
            time.sleep(0.02)
    else:
        store.set(joined_key(env.rank), "1")
    dist.init_process_group("gloo", store=store, rank=env.rank, world_size=env.world_size,
                            timeout=CONTROL_TIMEOUT)
    return DistGroups(env=env, store=store, control=dist.group.WORLD)


def init_compute(groups: DistGroups, device: str) -> None:
    """Every rank, together: pick the device and build the compute group the model's collectives use."""
    dev = compute_device(groups.env, device)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    backend = "nccl" if dev.type == "cuda" else "gloo"
    groups.compute = dist.new_group(list(range(groups.env.world_size)), backend=backend,
                                    timeout=compute_timeout())
    groups.device = dev
    from pagedserve.distributed import init_tp_group
    init_tp_group(groups.env.rank, groups.env.world_size, groups.compute)


def destroy_distributed() -> None:
    """Leave the groups and give this process back its single-rank TP group."""
    from pagedserve.distributed import reset_tp_group
    if dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception:  # a broken group (a peer died) may fail to tear down; it is gone either way
            pass
    reset_tp_group()


def error_key(rank: int) -> str:
    return f"error/{rank}"


def report_error(store: dist.Store, rank: int, message: str) -> None:
    """Leave this rank's failure where rank 0 will look for it; best effort (rank 0 may be gone)."""
    try:
        store.set(error_key(rank), message)
    except Exception:
        pass


def read_error(store: dist.Store, rank: int) -> str | None:
    try:
        if store.check([error_key(rank)]):
            return store.get(error_key(rank)).decode(errors="replace")
    except Exception:
        pass
    return None
