"""FillPool: long-lived threads that fill a step's bitmask rows, a serial xgrammar call per chunk.

Why: xgrammar's BatchGrammarMatcher(n).batch_fill_next_token_bitmask builds a new n-thread pool
on every call and joins it ("ThreadPool cannot be reused after Join()", cpp/grammar_matcher.cc,
BatchGrammarMatcher::Impl::BatchFillNextTokenBitmask), and queues one task a row. The engine
pays that start-up every step. Here the threads start once, on the first fill, and wait between
steps (benchmarks/kernels/structured_mask_cost.py --fill-compare times serial, xgrammar's threads
and this at 16-256 rows).

How: the rows are dealt into `chunks` (threads x chunks_per_thread, never more than the rows;
row k goes to chunk k mod chunks). The caller queues chunks 1.. on one shared queue, fills chunk
0 itself, then takes queued chunks until none is left; threads-1 workers take them too. Each
chunk is one BatchGrammarMatcher(1) batch fill (no thread pool), which gives up the GIL for its
whole run, so chunks fill at once; each writes only its own rows of the one shared bitmask.
A row's fill costs ~7 us at the median but a few rows cost 0.3-0.5 ms (128k BPE, JSON schemas):
more chunks than threads let a thread that drew cheap rows take more, as xgrammar's one task a
row does, at one queue hand-off (and a moment of the GIL) per chunk.

Invariants: fill() returns only once every chunk has ended (none still writes the bitmask), then
raises the first error any chunk raised; a mask it fills is bit-identical to one serial call's
(tests/engine/test_structured_fill_pool.py); close() stops and joins every worker and is
idempotent; a closed pool refuses to fill. One caller at a time (the step loop): the chunks'
results come back on one queue.

The GIL: a worker holds it for a moment to take a chunk and to come back from its fill. In an
inline step nobody else wants it then (the caller is in a fill or waiting). A thread running
Python meanwhile (PAGEDSERVE_GRAMMAR_FILL=overlap's helper) can delay a worker's start or return
by up to the interpreter's switch interval (5 ms), which xgrammar's own C++ threads never wait for.
"""
from __future__ import annotations

import queue
import threading
from typing import Any

import torch
import xgrammar as xgr

_STOP = None  # a work item that ends the worker taking it
# Chunks per thread: 1 deals each thread one strided share; more balance rows of unequal cost.
CHUNKS_PER_THREAD = 4


class FillPool:
    """`threads` fillers: the calling thread and threads - 1 daemon workers, started on first use."""

    def __init__(self, threads: int, chunks_per_thread: int = CHUNKS_PER_THREAD) -> None:
        if threads < 2:
            raise ValueError(f"FillPool needs threads >= 2 (1 is the serial fill), got {threads}")
        if chunks_per_thread < 1:
            raise ValueError(f"FillPool needs chunks_per_thread >= 1, got {chunks_per_thread}")
        self.threads = threads
        self.chunks_per_thread = chunks_per_thread
        self._fill = xgr.BatchGrammarMatcher(1).batch_fill_next_token_bitmask  # the caller's chunks
        self._work: queue.SimpleQueue = queue.SimpleQueue()   # chunks not yet taken, then _STOPs
        self._done: queue.SimpleQueue = queue.SimpleQueue()   # one item per worker's chunk: None or its error
        self._workers: list[threading.Thread] = []
        self._closed = False

    def _start(self) -> None:
        for k in range(1, self.threads):
            worker = threading.Thread(target=self._run, name=f"grammar-fill-{k}", daemon=True)
            worker.start()
            self._workers.append(worker)

    def _run(self) -> None:
        fill = xgr.BatchGrammarMatcher(1).batch_fill_next_token_bitmask
        while True:
            job = self._work.get()
            if job is _STOP:
                return
            matchers, bitmask, indices = job
            try:
                fill(matchers, bitmask, indices)
            except BaseException as e:  # handed to the caller, which re-raises it
                self._done.put(e)
            else:
                self._done.put(None)

    def fill(self, matchers: list[Any], bitmask: torch.Tensor, indices: list[int]) -> None:
        """Fill bitmask row indices[i] from matchers[i] for every i, as one serial
        batch_fill_next_token_bitmask(matchers, bitmask, indices) would."""
        if self._closed:
            raise RuntimeError("FillPool.fill after close()")
        if len(matchers) != len(indices):
            raise ValueError(f"FillPool.fill: {len(matchers)} matchers but {len(indices)} indices")
        chunks = min(self.threads * self.chunks_per_thread, len(matchers))
        if chunks <= 1:
            if matchers:
                self._fill(matchers, bitmask, indices)
            return
        if not self._workers:
            self._start()
        for c in range(1, chunks):
            self._work.put((matchers[c::chunks], bitmask, indices[c::chunks]))
        first: BaseException | None = None
        job = (matchers[::chunks], bitmask, indices[::chunks])
        by_workers = chunks - 1
        while job is not None:
            try:
                self._fill(*job)
            except BaseException as e:
                first = first or e
            try:
                job = self._work.get_nowait()
                by_workers -= 1
            except queue.Empty:
                job = None
        for _ in range(by_workers):  # every chunk ends before the bitmask is handed on
            error = self._done.get()
            if first is None:
                first = error
        if first is not None:
            raise first

    def close(self) -> None:
        """Stop and join every worker (a worker mid-fill finishes its chunk first)."""
        self._closed = True
        for _ in self._workers:
            self._work.put(_STOP)
        for worker in self._workers:
            worker.join()
        self._workers.clear()
