"""Pauses of a serving process's loop: keep the garbage collector out of them, and find the rest.

A full (oldest-generation) collection walks every object the interpreter tracks. After start-up
that is the model's modules, the tokenizer and everything imported; a collection that lands in
the middle of serving stalls the engine-core loop or the API server's event loop for as long as
the walk takes, and every request waiting on it sees that as latency. freeze_startup_heap()
moves what start-up left alive into the permanent generation the collector never walks (as vLLM
does); later garbage is collected as usual.

PAGEDSERVE_LOG_PAUSES_MS=N (default: off) logs, in the process that calls the installers, every
collection over N ms, every engine-core loop iteration over N ms (core.py) and every event-loop
stall over N ms in the API server: the tool for a latency tail that has no other explanation.
With PAGEDSERVE_LOG_GC_GARBAGE=1 beside it, a collection over N ms also names what its garbage
was made of (the most common types; frames and coroutines by their code): the collector then
keeps every piece of garbage it finds (gc.DEBUG_SAVEALL), so this is for a diagnostic run only.
"""
from __future__ import annotations

import asyncio
import gc
import logging
import os
import time
from contextlib import contextmanager
from typing import Iterator

logger = logging.getLogger(__name__)

LOG_PAUSES_ENV = "PAGEDSERVE_LOG_PAUSES_MS"
LOG_GC_GARBAGE_ENV = "PAGEDSERVE_LOG_GC_GARBAGE"


def pause_threshold_s() -> float | None:
    """The PAGEDSERVE_LOG_PAUSES_MS threshold in seconds, or None when unset/0."""
    raw = os.environ.get(LOG_PAUSES_ENV, "").strip()
    if not raw:
        return None
    try:
        ms = float(raw)
    except ValueError:
        raise ValueError(f"{LOG_PAUSES_ENV} must be a number of milliseconds, got {raw!r}") from None
    return ms / 1000.0 if ms > 0 else None


@contextmanager
def heap_frozen_meanwhile() -> Iterator[None]:
    """Within the block, no collection walks the objects that existed before it; after it,
    they are collectable again, so nothing leaks. For offline generation in the caller's own
    process, where freezing for good (freeze_startup_heap) would keep a dropped engine's cyclic
    garbage forever. Both gc.freeze and gc.unfreeze move whole generations: O(1). Does nothing
    if something else froze the heap already (a server process, or the caller)."""
    if gc.get_freeze_count():
        yield
        return
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def freeze_startup_heap() -> int:
    """Collect once, then exempt every surviving object from future collections; returns how many."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


# The collector's thresholds in a serving process (CPython's are (700, 10, 10)). A young
# collection runs every 700 net new container objects, which thousands of open streams create
# in well under a millisecond, and each one promotes whatever is alive at that instant (outputs
# waiting in queues, chunks being written); the oldest generation then grows fast enough that a
# full collection, walking every object of every open stream, came about once a second in the
# API server, up to 300-470 ms each; collections took a fifth of its time (3000 streams on our
# 2-core CPU, benchmarks/dashboard/dashboard_latency.py, docs/dashboard.md). With these, most of that
# garbage is freed by reference counting before a young collection sees it, and no full
# collection ran in the same runs. Cyclic garbage waits a little longer: a few MB at most.
SERVING_GC_THRESHOLDS = (50_000, 20, 20)


def set_serving_gc_thresholds() -> None:
    gc.set_threshold(*SERVING_GC_THRESHOLDS)


def install_gc_pause_log(process: str) -> bool:
    """Log collections longer than the threshold (no-op without PAGEDSERVE_LOG_PAUSES_MS)."""
    threshold = pause_threshold_s()
    if threshold is None:
        return False
    started: dict[int, float] = {}
    keep_garbage = os.environ.get(LOG_GC_GARBAGE_ENV, "").strip() not in ("", "0")
    if keep_garbage:
        gc.set_debug(gc.DEBUG_SAVEALL)
    seen = len(gc.garbage)

    def on_gc(phase: str, info: dict) -> None:
        nonlocal seen
        gen = info.get("generation", -1)
        if phase == "start":
            started[gen] = time.perf_counter()
        elif gen in started:
            took = time.perf_counter() - started.pop(gen)
            if took >= threshold:
                what = f"; garbage: {describe_garbage(gc.garbage[seen:])}" if keep_garbage else ""
                logger.warning("%s: gc generation %d took %.1f ms (collected %d)%s", process, gen, took * 1e3,
                               info.get("collected", 0), what)
            seen = len(gc.garbage)
    gc.callbacks.append(on_gc)
    return True


def describe_garbage(objects: list, top: int = 12) -> str:
    """The most common kinds among `objects`, e.g. "frame Foo.bar x120, dict x80"."""
    from collections import Counter

    def kind(o: object) -> str:
        name = type(o).__qualname__
        if type(o).__module__ not in ("builtins", None):
            name = f"{type(o).__module__}.{name}"
        try:  # garbage may be anything, with a __getattr__ that raises anything: the line must still go out
            code = getattr(o, "f_code", None) or getattr(o, "cr_code", None) or getattr(o, "ag_code", None) \
                or getattr(o, "gi_code", None) or getattr(o, "__code__", None)
            if code is not None:
                return f"{name} {code.co_qualname}"
            if isinstance(o, dict):  # an instance's __dict__ or a message: its keys say whose
                return f"{name}[{','.join(sorted(str(k)[:24] for k in list(o)[:40])[:4])}]"
            return name
        except Exception:
            return name
    return ", ".join(f"{k} x{n}" for k, n in Counter(map(kind, objects)).most_common(top)) or "none kept"


async def watch_event_loop(process: str, period_s: float = 0.01) -> None:
    """Log every time this event loop could not run a 10 ms timer for longer than the threshold."""
    threshold = pause_threshold_s()
    if threshold is None:
        return
    loop = asyncio.get_running_loop()
    while True:
        t0 = loop.time()
        await asyncio.sleep(period_s)
        lag = loop.time() - t0 - period_s
        if lag >= threshold:
            logger.warning("%s: event loop stalled %.1f ms", process, lag * 1e3)
