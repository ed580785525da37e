"""A step's token bitmask: filled on the host by xgrammar, uploaded and applied without a wait.

With overlapped steps the host fills step N+1's mask while the device runs N+1's forward, so the
host time here is on the step's critical path whenever the device is fast, and a hidden device
sync would end the overlap altogether. Hence:

- The matchers take their tokens in the calling thread (~1-10 us a row), then fill their rows in
  one batch_fill_next_token_bitmask call on xgrammar's own C++ threads (~1-150 us a row with a
  128k vocabulary, by grammar state). xgrammar starts and joins that pool on every call
  (cpp/grammar_matcher.cc), a cost paid every step, but its workers never take the GIL
  (PAGEDSERVE_GRAMMAR_FILL_POOL=1: fill_pool.py's threads, started once, instead). Python
  threads over slices of the rows (accept and fill per slice) measured worse on the H200: TPOT
  p50 overhead 1.25 at 40 req/s against 1.069 with this fill (docs/benchmarks-history.md), the workers'
  Python between the GIL-releasing calls contending with the step loop.
- MaskBuffers: two pinned host bitmasks (and index vectors) take turns, and one persistent device
  bitmask (and index vector) receives them by non-blocking copies queued on the logits' stream, in
  front of xgrammar's kernel. Nothing is allocated per step, and no pageable memory is copied
  (xgrammar turns a list of indices into a pageable tensor and copies it on every call).

Invariants: a host buffer is written only after the device has finished reading it (the event
recorded behind its last copy; in the engine it has always passed by then, because the host waited
for a later step's tokens, so the check costs no wait). The device buffers are written and read on
the same stream, so a copy never overtakes the kernel that reads the previous step's mask.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch

# xgrammar's threads are worth starting from about this many rows.
BATCH_FILL_MIN_ROWS = 8


def default_fill_threads() -> int:
    """Half the CPUs this process may run on (xgrammar's own 'auto'), at most 8: the engine's
    process shares the machine with the API server and the tokenizers."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cpus = os.cpu_count() or 1
    return max(1, min(8, cpus // 2))


@dataclass(slots=True)
class StepMask:
    """A host bitmask: row i holds the mask of logits row i for i in `indices` (increasing);
    `rows` = indices[-1] + 1 rows are uploaded. `slot`: which of MaskBuffers' host buffers."""
    bitmask: torch.Tensor
    rows: int
    indices: list[int]
    slot: int


class MaskBuffers:
    """Host bitmask buffers (pinned when the logits live on a GPU) and the device copies."""

    def __init__(self, words: int, pinned: bool) -> None:
        self.words = words
        self.pinned = pinned
        self.capacity = 0
        self._host: list[torch.Tensor] = []
        self._host_indices: list[torch.Tensor] = []
        self._copied: list[torch.cuda.Event | None] = [None, None]  # behind each host buffer's last copy
        self._slot = 0
        self._device: torch.Tensor | None = None
        self._device_indices: torch.Tensor | None = None

    def take(self, rows: int) -> tuple[int, torch.Tensor]:
        """The next host buffer (at least `rows` rows), once the device no longer reads it."""
        if rows > self.capacity:
            self.capacity = max(rows, 2 * self.capacity, 16)
            # A buffer being replaced may still be read by a copy: the caching host allocator,
            # which recorded that copy, keeps its memory until it ends.
            self._host = [torch.empty((self.capacity, self.words), dtype=torch.int32, pin_memory=self.pinned)
                          for _ in range(2)]
            self._host_indices = [torch.empty(self.capacity, dtype=torch.int32, pin_memory=self.pinned)
                                  for _ in range(2)]
        self._slot ^= 1
        event = self._copied[self._slot]
        if event is not None:
            event.synchronize()  # long passed in the engine (see the module docstring)
        return self._slot, self._host[self._slot]

    def upload(self, mask: StepMask, device: torch.device, with_indices: bool
               ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Queue the copies of the mask's rows (and its indices) to the device; no host wait."""
        if self._device is None or self._device.shape[0] < self.capacity or self._device.device != device:
            self._device = torch.empty((self.capacity, self.words), dtype=torch.int32, device=device)
            self._device_indices = torch.empty(self.capacity, dtype=torch.int32, device=device)
        bitmask = self._device[:mask.rows]
        bitmask.copy_(mask.bitmask[:mask.rows], non_blocking=True)
        indices = None
        if with_indices:
            n = len(mask.indices)
            host = self._host_indices[mask.slot]
            host.numpy()[:n] = mask.indices
            indices = self._device_indices[:n]
            indices.copy_(host[:n], non_blocking=True)
        if self.pinned:
            event = self._copied[mask.slot]
            if event is None:
                event = self._copied[mask.slot] = torch.cuda.Event()
            event.record(torch.cuda.current_stream(device))
        return bitmask, indices
