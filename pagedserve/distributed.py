"""Tensor-parallel group: who am I among the ranks that split one model.

Until a multi-process runtime installs a real group (init_tp_group; reset_tp_group
undoes it), the group is rank 0 of size 1 and every collective here is a no-op that never touches
torch.distributed, so single-device code pays nothing for being TP-aware.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class TPGroup:
    rank: int = 0
    size: int = 1
    group: object = None  # a torch.distributed ProcessGroup when size > 1
    # Optional faster path for the messages it fits (runner/symm_allreduce.py); None: all go to `group`.
    fast_all_reduce: object = None


_TP_GROUP = TPGroup()


def get_tp_group() -> TPGroup:
    return _TP_GROUP


def init_tp_group(rank: int, size: int, group: object = None) -> TPGroup:
    """Install the process's TP group (called once by the multi-process runtime)."""
    global _TP_GROUP
    if not 0 <= rank < size:
        raise ValueError(f"tp rank must be in [0, {size}), got {rank}")
    _TP_GROUP = TPGroup(rank=rank, size=size, group=group)
    return _TP_GROUP


def reset_tp_group() -> TPGroup:
    """Back to the single-rank group (the multi-process runtime calls this when it tears down)."""
    global _TP_GROUP
    _TP_GROUP = TPGroup()
    return _TP_GROUP


class CollectiveError(RuntimeError):
    """A collective over the TP group failed: a peer died, or stopped answering within the timeout."""


def all_reduce(x: torch.Tensor, tp_size: int | None = None) -> torch.Tensor:
    """Sum x over the TP ranks, in place; identity at size 1."""
    g = get_tp_group()
    if (tp_size if tp_size is not None else g.size) == 1:
        return x
    fast = g.fast_all_reduce
    if fast is not None and fast.fits(x):
        return fast(x)
    import torch.distributed as dist
    try:
        dist.all_reduce(x, group=g.group)
    except RuntimeError as e:
        raise CollectiveError(f"all_reduce over the tensor-parallel group failed: {e}") from e
    return x


def all_gather(x: torch.Tensor, dim: int = -1, tp_size: int | None = None) -> torch.Tensor:
    """Concatenate each rank's x along dim, in rank order; identity at size 1."""
    g = get_tp_group()
    size = tp_size if tp_size is not None else g.size
    if size == 1:
        return x
    import torch.distributed as dist
    parts = [torch.empty_like(x) for _ in range(size)]
    try:
        dist.all_gather(parts, x.contiguous(), group=g.group)
    except RuntimeError as e:
        raise CollectiveError(f"all_gather over the tensor-parallel group failed: {e}") from e
    return torch.cat(parts, dim=dim)


def broadcast(x: torch.Tensor, src: int = 0, tp_size: int | None = None) -> torch.Tensor:
    """Rank src's x into every rank's x (same shape and dtype everywhere), in place; identity at size 1."""
    g = get_tp_group()
    if (tp_size if tp_size is not None else g.size) == 1:
        return x
    import torch.distributed as dist
    try:
        dist.broadcast(x, src=src, group=g.group)
    except RuntimeError as e:
        raise CollectiveError(f"broadcast over the tensor-parallel group failed: {e}") from e
    return x
