"""How one step's sampled ids reach the next step on every tensor-parallel rank (overlapped steps).

With overlapped steps (EngineConfig.async_scheduling) step N+1 is launched before step N's
sampled ids reach rank 0's host: a decode whose newest token is still in flight runs a
placeholder, filled on the device from N's ids (ModelInput.fill_placeholders). One rank has those
ids on its device because it sampled them. With tensor parallelism every rank runs the forward of
N+1, so every rank needs them on its own device, and the command for N+1 (built on rank 0's host
from the plan alone) cannot carry them.

The choice: rank 0 samples, as it does without overlap, and broadcasts the ids over the compute
group (NCCL on GPUs, gloo on the CPU) as the last collective of step N; each other rank keeps
what it received for step N+1. Why not let every rank sample the same ids itself? The logits are
already all-gathered on every rank, so that would save this one collective, but:
  - exactness would rest on every rank repeating rank 0's draws bit for bit: the same shared
    generator consumed in the same order, a copy of every per-request seeded generator (and of
    each fork's), every row's sampling parameters shipped with each step, and kernels that give
    the same bits on every device. A single divergent draw leaves a rank computing KV for a token
    rank 0 never appended: wrong text, and no error. Broadcast ids are rank 0's ids by
    construction, whatever the sampler does;
  - the sampler and its state stay in one place (the engine on rank 0), so the runner keeps
    carrying out plans and never samples;
  - the cost is one broadcast of num_sampling int64 ids per step (2 KiB at 256 sequences), queued
    on the device stream like the model's all-reduces: no host round trip, nothing waits for it
    but the next step's placeholder fill.
Steps that do not overlap (StepInput.share_sampled False: the synchronous path, warm-up) skip it:
their next step's tokens travel in the command.
"""
from __future__ import annotations

from typing import Callable

import torch

from pagedserve.distributed import broadcast


class SampledIdRelay:
    """One rank's end of the relay: shares a step's ids, and holds them for the next step."""

    def __init__(self, rank: int):
        self.rank = rank
        self._ids: torch.Tensor | None = None  # ranks > 0: the ids the last step shared

    def take(self) -> torch.Tensor | None:
        """The ids the previous step shared (None on rank 0, whose engine holds its own copy, and
        after a step that shared none: a placeholder then fails loudly rather than read stale ids)."""
        ids, self._ids = self._ids, None
        return ids

    def share(self, logits: torch.Tensor, sample: Callable | None):
        """After the step's forward, on every rank alike: rank 0 samples (sample(logits) -> a
        DeviceSample, returned) and sends the ids; the other ranks receive them (returns None)."""
        if self.rank == 0:
            if sample is None:
                raise ValueError("rank 0 must sample a step that shares its sampled ids")
            drawn = sample(logits)
            ids = drawn.tokens
            if ids.dtype != torch.int64 or ids.shape != (logits.shape[0],) or not ids.is_contiguous():
                # Every rank sizes its buffer from its own logits: the shapes must agree exactly.
                raise ValueError(f"sampled ids must be contiguous int64 [{logits.shape[0]}], got "
                                 f"{ids.dtype} {tuple(ids.shape)}")
            broadcast(ids, src=0)
            return drawn
        ids = torch.empty(logits.shape[0], dtype=torch.int64, device=logits.device)
        self._ids = broadcast(ids, src=0)
        return None
