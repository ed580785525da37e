"""A CPU stand-in for torch.cuda.CUDAGraph with a graph's semantics: fixed memory, replayed kernels.

capture_begin .. capture_end records every aten op that runs (through a TorchDispatchMode) with
the very tensors it read and wrote. replay() runs the same ops again on those same tensors and
writes each fresh result into the recorded output's memory, so a replay sees whatever the static
buffers hold now, exactly like a CUDA graph replay reads fixed device addresses. Code that forgot
to copy an input into a static buffer, or that reads a tensor a later capture reused, gives wrong
results here just as it would on the GPU. (Unlike CUDA capture, the ops also run while recording.)
"""
from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class _Recorder(TorchDispatchMode):
    def __init__(self, ops: list):
        super().__init__()
        self.ops = ops

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self.ops.append((func, args, kwargs, [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]))
        return out


class RecordedGraph:
    """Same surface as torch.cuda.CUDAGraph as used by runner/piecewise_graphs.py."""
    instances: list["RecordedGraph"] = []

    def __init__(self):
        self.ops: list = []
        self.num_replays = 0
        self._mode: _Recorder | None = None
        RecordedGraph.instances.append(self)

    def capture_begin(self, pool=None) -> None:
        if self._mode is not None:
            raise RuntimeError("capture already begun")
        self._mode = _Recorder(self.ops)
        self._mode.__enter__()

    def capture_end(self) -> None:
        self._mode.__exit__(None, None, None)
        self._mode = None

    def pool(self):
        return "recorded-pool"

    def replay(self) -> None:
        self.num_replays += 1
        for func, args, kwargs, outs in self.ops:
            fresh = [t for t in tree_leaves(func(*args, **kwargs)) if isinstance(t, torch.Tensor)]
            for recorded, new in zip(outs, fresh):
                # In-place ops and views return the recorded memory itself; new allocations are
                # written back into the recorded tensor, the graph's fixed address.
                if new.numel() and new.data_ptr() != recorded.data_ptr():
                    recorded.copy_(new)
