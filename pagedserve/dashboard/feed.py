"""The dashboard's data feed: throttled snapshots, the public JSON, and incremental SSE frames.

A snapshot costs O(blocks) on the engine thread, so every reader (the JSON endpoint and
every open page) shares one: a snapshot younger than min_interval is served again instead of
taking a new one, and concurrent readers wait on the same in-flight call. Each snapshot gets
a version number, so a reader can tell which one it holds. Nothing here runs per engine step;
with no page open nothing runs at all.
"""
from __future__ import annotations

import asyncio
import json
import re
import time
from typing import AsyncIterator, Awaitable, Callable

from pagedserve.core.kv_state import STATE_NAMES, block_owners, state_names

MIN_SNAPSHOT_INTERVAL_S = 0.25
# Snapshots may take at most this share of the engine thread's time (the dashboard's allowance,
# issue #17: at most a 2% drop with the page open): a very large cache is then refreshed less
# often rather than slowing the engine down. 65,536 blocks cost ~5 ms on an H200 host: 2 Hz.
SNAPSHOT_TIME_BUDGET = 0.02
# A reader polling at the feed's own interval must not find the last snapshot a hair too young
# (timers fire up to the clock's resolution early) and skip a frame: every other frame was lost so.
FRESHNESS_SLACK = 0.1
# The cost behind the budget is a running average (the newest snapshot weighs this much): one
# snapshot slowed by a busy host must not stop the feed for seconds (at 2%, 100 ms meant 5 s).
COST_WEIGHT = 0.25
STREAM_INTERVAL_RANGE_S = (0.25, 10.0)
# The stream's interval when the page asks for none: 2.5 Hz, a margin over the 2 Hz so that
# a late frame or a count over a few seconds does not fall below it (at 0.5 s a 17 s window holds
# 34 frames: one late tick and it reads 1.94 Hz). Within the budget: 2.5 snapshots/s at 2% leave
# 8 ms each; at 65,536 blocks and ~1,000 running requests one costs 2-4 ms on our CPU when idle
# (one letter per block; 4.3 ms before), 8-9 ms at p90 with more busy processes than cores; the
# H200 host measured ~7 ms before that change. A costlier snapshot stretches the feed's own
# interval (above), never the engine's time.
DEFAULT_STREAM_INTERVAL_S = 0.4
_DIFFED = ("states",)  # the sparse cpu_states (swapped-out blocks only) travel whole


class ThrottledSnapshot:
    """At most one snapshot per min_interval seconds, shared by all readers."""

    def __init__(self, take: Callable[[], Awaitable[dict]], min_interval: float = MIN_SNAPSHOT_INTERVAL_S,
                 extra: Callable[[], dict] | None = None, budget: float = SNAPSHOT_TIME_BUDGET) -> None:
        self._take = take
        self._extra = extra
        self.min_interval = min_interval
        self.budget = budget
        self.interval = min_interval  # min_interval, or longer if snapshots cost more than the budget
        self._last: dict | None = None
        self._taken_at = float("-inf")
        self._lock: asyncio.Lock | None = None
        self._cost: float | None = None  # running average of snapshot_s (COST_WEIGHT)
        self.version = 0

    async def get(self, newer_than: int | None = None, wait_up_to: float = 0.0) -> dict:
        """The latest snapshot (a dict with a 'version'); callers must not modify it.

        newer_than: the version the caller already holds. If the latest is that one and still
        too young to replace, wait (up to wait_up_to seconds) until a new one may be taken
        rather than hand the same one back: a reader whose tick comes early after a late one
        (a busy event loop) then sends its frame a little late instead of skipping it.
        """
        if self._lock is None:
            self._lock = asyncio.Lock()
        while True:
            async with self._lock:
                now = time.monotonic()
                wait = self._taken_at + self.interval * (1 - FRESHNESS_SLACK) - now
                if self._last is None or wait <= 0:
                    return await self._refresh(now)
                if newer_than is None or self._last["version"] > newer_than or wait > wait_up_to:
                    return self._last
            await asyncio.sleep(wait)

    async def _refresh(self, now: float) -> dict:
        # Aged from when it was asked for: the wait for the engine thread is not its age.
        self._taken_at = now
        state = await self._take()
        cost = state.get("snapshot_s", 0.0)
        self._cost = cost if self._cost is None else self._cost + COST_WEIGHT * (cost - self._cost)
        self.interval = max(self.min_interval, self._cost / self.budget)
        self.version += 1
        state["version"] = self.version
        state["time"] = time.time()
        if self._extra is not None:
            state.update(self._extra())
        self._last = state
        return state


def public_state(snapshot: dict) -> dict:
    """GET /kv_cache/state: the snapshot plus, per device block, its state and owners
    ([request_id, seq_id, logical block index] for each table entry pointing at it), and the
    same for each swapped-out CPU block."""
    owners = block_owners(snapshot)
    cpu_owners = block_owners(snapshot, "cpu")
    out = {k: v for k, v in snapshot.items() if k not in ("states", "cpu_states", "state_names")}
    out["blocks"] = [{"block": i, "state": s, "owners": owners.get(i, [])}
                     for i, s in enumerate(state_names(snapshot["states"]))]
    # Only the swapped-out CPU blocks: the other num_cpu_blocks are free.
    out["cpu_blocks"] = [{"block": int(i), "state": s, "owners": cpu_owners.get(int(i), [])}
                         for i, s in snapshot["cpu_states"].items()]
    return out


_CHANGED_RUN = re.compile(rb"[^\x00]+")


def _changes(prev: str, cur: str) -> list[list]:
    """[start, new letters] of each run of changed cells (states are one ASCII letter per block).
    XOR of the two as integers leaves a zero byte wherever a cell is unchanged, and the regex finds
    the runs of the others: both in C, so 65,536 cells cost ~0.1 ms instead of a Python loop."""
    if prev == cur:
        return []
    a, b = int.from_bytes(prev.encode("ascii"), "big"), int.from_bytes(cur.encode("ascii"), "big")
    xor = (a ^ b).to_bytes(len(cur), "big")
    return [[m.start(), cur[m.start():m.end()]] for m in _CHANGED_RUN.finditer(xor)]


def _table_diffs(prev_requests: list[dict], requests: list[dict]) -> list[dict]:
    """The requests with each sequence's table replaced by what grew since prev ('append')
    when the old table is a prefix of the new one (the usual case), else sent whole."""
    old = {(s["seq_id"], s["where"]): s["block_table"] for r in prev_requests for s in r["seqs"]}
    out = []
    for r in requests:
        seqs = []
        for s in r["seqs"]:
            table = s["block_table"]
            before = old.get((s["seq_id"], s["where"]))
            entry = {k: v for k, v in s.items() if k != "block_table"}
            if before is not None and len(before) <= len(table) and table[:len(before)] == before:
                entry["append"] = table[len(before):]
            else:
                entry["block_table"] = table
            seqs.append(entry)
        out.append(dict(r, seqs=seqs))
    return out


def make_frame(prev: dict | None, snapshot: dict) -> dict:
    """One SSE frame: 'full' (every block state, one letter each, and every table) when the reader
    has nothing comparable yet, else 'diff': only the runs of cells that changed since prev (see
    _changes) and only what each block table grew by (see _table_diffs); counters and the sparse
    CPU states whole. state_names spells the letters out for the page."""
    frame = {k: v for k, v in snapshot.items() if k not in _DIFFED}
    frame["state_names"] = STATE_NAMES
    comparable = prev is not None and all(len(prev[k]) == len(snapshot[k]) for k in _DIFFED)
    if not comparable:
        frame["type"] = "full"
        for k in _DIFFED:
            frame[k] = snapshot[k]
    else:
        frame["type"] = "diff"
        for k in _DIFFED:
            frame[k + "_changed"] = _changes(prev[k], snapshot[k])
        frame["requests"] = _table_diffs(prev["requests"], snapshot["requests"])
    return frame


def parse_interval(raw: str | None, default: float = DEFAULT_STREAM_INTERVAL_S) -> float:
    """The stream's ?interval= in seconds; ValueError names the field and the range."""
    lo, hi = STREAM_INTERVAL_RANGE_S
    if raw is None:
        return default
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"interval must be a number of seconds in [{lo}, {hi}], got {raw!r}") from None
    if not lo <= value <= hi:
        raise ValueError(f"interval must be in [{lo}, {hi}] seconds, got {value}")
    return value


async def sse_frames(feed: ThrottledSnapshot, interval: float) -> AsyncIterator[bytes]:
    """Server-sent events, one frame per interval: a full frame first, then diffs."""
    prev = None
    due = time.monotonic()
    while True:
        # Wait for a new snapshot rather than skip the tick, unless none may come before the next.
        snapshot = await feed.get(None if prev is None else prev["version"], wait_up_to=interval)
        if prev is None or snapshot["version"] != prev["version"]:
            frame = make_frame(prev, snapshot)
            prev = snapshot
            yield b"data: " + json.dumps(frame, separators=(",", ":")).encode() + b"\n\n"
        else:
            yield b": idle\n\n"  # keeps proxies and the reader's liveness check happy
        # A fixed grid, not a fixed pause: a late tick (the wait for the engine thread, a busy
        # event loop) leaves the next ones where they were. Up to one interval behind, the next
        # tick catches up (the feed's own interval spaces it); restarting the grid at any tick more
        # than an interval late lost that time for good, and under load on CPU the event loop
        # stalls for 0.4-0.6 s at a time. Further behind, the grid moves on rather than burst.
        now = time.monotonic()
        due = max(due + interval, now - interval)
        await asyncio.sleep(due - now)
