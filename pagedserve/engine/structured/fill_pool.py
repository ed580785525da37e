"""FillPool: long-lived threads that fill a step's bitmask rows, each share one serial xgrammar call.

Why: xgrammar's BatchGrammarMatcher(n).batch_fill_next_token_bitmask builds a new n-thread pool
on every call and joins it ("ThreadPool cannot be reused after Join()", cpp/grammar_matcher.cc,
BatchGrammarMatcher::Impl::BatchFillNextTokenBitmask), and queues one task a row. The engine
pays that start-up every step. Here the threads start once, on the first fill, and wait between
steps (benchmarks/kernels/structured_mask_cost.py --fill-compare times serial, xgrammar's threads
and this at 16-256 rows).

How: the rows are dealt out in `shares` (at most `threads`, never more than the rows; row k goes
to share k mod shares, so rows a grammar makes costly, wherever they sit, spread evenly). The
caller's thread fills share 0 itself and threads-1 workers fill the others. Each share is one
BatchGrammarMatcher(1) batch fill (no thread pool), which gives up the GIL for its whole run, so
the shares run at once; each writes only its own rows of the one shared bitmask.

Invariants: fill() returns only once every share has ended (none still writes the bitmask), then
raises the first error any share raised; a mask it fills is bit-identical to one serial call's
(tests/engine/test_structured_fill_pool.py); close() stops and joins every worker and is
idempotent; a closed pool refuses to fill. One caller at a time (the step loop): the shares'
results come back on one queue.

The GIL: a worker holds it for a moment to wake and to come back from its fill. In an inline step
nobody else wants it then (the caller is in its own fill or waiting). A thread running Python
meanwhile (PAGEDSERVE_GRAMMAR_FILL=overlap's helper) can delay a worker's start or return by up
to the interpreter's switch interval (5 ms), which xgrammar's own C++ threads never wait for.
"""
from __future__ import annotations

import queue
import threading
from typing import Any

import torch
import xgrammar as xgr

_STOP = None  # a worker's queue item that ends it


class FillPool:
    """`threads` fillers: the calling thread and threads - 1 daemon workers, started on first use."""

    def __init__(self, threads: int) -> None:
        if threads < 2:
            raise ValueError(f"FillPool needs threads >= 2 (1 is the serial fill), got {threads}")
        self.threads = threads
        self._fill = xgr.BatchGrammarMatcher(1).batch_fill_next_token_bitmask  # the caller's share
        self._inboxes: list[queue.SimpleQueue] = []
        self._workers: list[threading.Thread] = []
        self._done: queue.SimpleQueue = queue.SimpleQueue()  # one item per ended share: None or its error
        self._closed = False

    def _start(self) -> None:
        for k in range(1, self.threads):
            inbox: queue.SimpleQueue = queue.SimpleQueue()
            worker = threading.Thread(target=self._work, args=(inbox,), name=f"grammar-fill-{k}", daemon=True)
            worker.start()
            self._inboxes.append(inbox)
            self._workers.append(worker)

    def _work(self, inbox: queue.SimpleQueue) -> None:
        fill = xgr.BatchGrammarMatcher(1).batch_fill_next_token_bitmask
        while True:
            job = inbox.get()
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
        shares = min(self.threads, len(matchers))
        if shares <= 1:
            if matchers:
                self._fill(matchers, bitmask, indices)
            return
        if not self._workers:
            self._start()
        for k in range(1, shares):
            self._inboxes[k - 1].put((matchers[k::shares], bitmask, indices[k::shares]))
        first: BaseException | None = None
        try:
            self._fill(matchers[::shares], bitmask, indices[::shares])
        except BaseException as e:
            first = e
        for _ in range(shares - 1):  # every share ends before the bitmask is handed on
            error = self._done.get()
            if first is None:
                first = error
        if first is not None:
            raise first

    def close(self) -> None:
        """Stop and join every worker (a worker mid-fill finishes its share first)."""
        self._closed = True
        for inbox in self._inboxes:
            inbox.put(_STOP)
        for worker in self._workers:
            worker.join()
        self._inboxes.clear()
        self._workers.clear()
