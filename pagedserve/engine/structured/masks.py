"""A step's token bitmask: filled on the host by xgrammar, uploaded and applied without a wait.

With overlapped steps the host fills step N+1's mask while the device runs N+1's forward, so the
host time here is on the step's critical path whenever the device is fast, and a hidden device
sync would end the overlap altogether. Hence:

- RowThreads: the matchers take their tokens (BatchGrammarMatcher.batch_accept_token) and fill
  their rows (batch_fill_next_token_bitmask), both of which release the GIL, over interleaved
  slices of the rows on a few persistent threads. xgrammar's own max_threads > 1 starts and joins
  a fresh thread pool on every fill call (cpp/grammar_matcher.cc: a ThreadPool cannot be reused
  after Join), a cost paid every step; with a 128k vocabulary a row costs ~1-10 us to accept and
  ~1-150 us to fill, by grammar state.
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
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable

import torch

# A thread is worth its dispatch (~10-20 us) from about this many rows of its own.
MIN_ROWS_PER_THREAD = 8


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
    """A filled host bitmask: row i holds the mask of logits row i for i in `indices` (increasing);
    `rows` = indices[-1] + 1 rows are uploaded. `slot`: which of MaskBuffers' host buffers."""
    bitmask: torch.Tensor
    rows: int
    indices: list[int]
    slot: int


class RowThreads:
    """Runs per-row xgrammar work (accepting a token, filling a bitmask row: both release the GIL)
    over interleaved slices of a step's rows on `threads` persistent threads, this one included.
    Interleaved: a row's cost depends on its grammar state (inside a string most of a large
    vocabulary is allowed), and neighbours in the batch are no more alike than others."""

    def __init__(self, threads: int) -> None:
        if threads < 1:
            raise ValueError(f"fill_threads must be >= 1, got {threads}")
        self.threads = threads
        self._pool: ThreadPoolExecutor | None = None

    def map_slices(self, work: Callable[[list], None], rows: list) -> None:
        """work(slice) for slices that together hold every row once; returns when all are done."""
        parts = min(self.threads, len(rows) // MIN_ROWS_PER_THREAD)
        if parts <= 1:
            work(rows)
            return
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.threads - 1, thread_name_prefix="grammar-rows")
        futures = [self._pool.submit(work, rows[k::parts]) for k in range(1, parts)]
        work(rows[::parts])
        for f in futures:
            f.result()

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown()
            self._pool = None


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
