"""Reading (a slice of) a checkpoint tensor into a parameter.

A loaded weight is either a torch.Tensor or a safetensors slice (safe_open(...).get_slice),
so a tensor-parallel rank materialises only its own rows or columns of a big matrix.
"""
from __future__ import annotations

import torch


def loaded_shape(w) -> tuple[int, ...]:
    return tuple(w.shape) if isinstance(w, torch.Tensor) else tuple(w.get_shape())


def narrow(w, dim: int, start: int, size: int) -> torch.Tensor:
    """w[..., start:start+size, ...] along dim, read from disk only for that range."""
    if isinstance(w, torch.Tensor):
        return w.narrow(dim, start, size)
    index = tuple([slice(None)] * dim + [slice(start, start + size)])
    return w[index]


def materialize(w) -> torch.Tensor:
    if isinstance(w, torch.Tensor):
        return w
    return w[()] if not w.get_shape() else w[:]  # a 0-d slice (a per-tensor scale) cannot take [:]


def copy_checked(dst: torch.Tensor, src: torch.Tensor, what: str = "weight") -> None:
    if tuple(dst.shape) != tuple(src.shape):
        raise ValueError(f"{what}: checkpoint shape {tuple(src.shape)} does not match parameter {tuple(dst.shape)}")
    with torch.no_grad():
        dst.copy_(src)


def default_weight_loader(param: torch.Tensor, loaded_weight, shard_id=None) -> None:
    """A replicated parameter: the whole checkpoint tensor, same shape."""
    copy_checked(param.data, materialize(loaded_weight))
