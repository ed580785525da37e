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


class RowWindow:
    """Rows [start, start + rows) of a safetensors slice, itself a lazy slice: indexing it reads
    only what the index asks for (a tensor-parallel rank's part of one part of a fused tensor)."""

    def __init__(self, inner, start: int, rows: int):
        self.inner, self.start, self.rows = inner, start, rows

    def get_shape(self) -> list[int]:
        return [self.rows, *self.inner.get_shape()[1:]]

    def get_dtype(self):
        return self.inner.get_dtype()

    def __getitem__(self, index):
        index = index if isinstance(index, tuple) else (index,)
        first = index[0] if index else slice(None)
        if not isinstance(first, slice) or first.step not in (None, 1):
            raise TypeError(f"RowWindow takes unit-step slices, got {first!r}")
        a, b, _ = first.indices(self.rows)
        return self.inner[(slice(self.start + a, self.start + b), *index[1:])]


def rows_of(w, start: int, rows: int):
    """w's rows [start, start + rows), read lazily where w is a safetensors slice."""
    return w.narrow(0, start, rows) if isinstance(w, torch.Tensor) else RowWindow(w, start, rows)


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
