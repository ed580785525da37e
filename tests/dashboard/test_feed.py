"""The dashboard feed: shared throttled snapshots, SSE diffs that rebuild the exact states,
the public JSON's owners, and the interval check."""
import asyncio
import json
import random

import pytest

from core.core_helpers import Driver, make_group, make_scheduler
from pagedserve.core.kv_state import block_owners, kv_cache_state, state_names
from pagedserve.dashboard.feed import (ThrottledSnapshot, _changes, make_frame, parse_interval, public_state,
                                       sse_frames)


def _busy_scheduler():
    sched = make_scheduler(24, block_size=4, num_cpu_blocks=8, preemption_mode="swap")
    for i in range(4):
        sched.add_seq_group(make_group(str(i), [1, 2, 3, 4, 5, 6] + [i] * 3, max_tokens=10, n=1 + i % 2))
    return sched, Driver(sched)


def test_diff_frames_rebuild_every_step_exactly():
    sched, driver = _busy_scheduler()
    prev, shown, tables, diffs, appends = None, None, {}, 0, 0
    while sched.has_unfinished_seqs():
        driver.step()
        snap = kv_cache_state(sched)
        frame = json.loads(json.dumps(make_frame(prev, snap)))  # as the page receives it
        if frame["type"] == "full":
            shown = list(frame["states"])
            tables = {}
        else:
            diffs += 1
            assert "states" not in frame
            for start, run in frame["states_changed"]:  # as the page applies them
                shown[start:start + len(run)] = run
            # Only the changed cells travel.
            sent = sum(len(run) for _, run in frame["states_changed"])
            assert sent == sum(a != b for a, b in zip(prev["states"], snap["states"]))
        assert "".join(shown) == snap["states"] and frame["cpu_states"] == snap["cpu_states"]
        assert [frame["state_names"][c] for c in shown] == state_names(snap["states"])
        rebuilt = {}
        for r in frame["requests"]:
            for q in r["seqs"]:
                key = (q["where"], q["seq_id"])
                rebuilt[key] = q["block_table"] if "block_table" in q else tables[key] + q["append"]
                appends += "append" in q
        assert rebuilt == {(q["where"], q["seq_id"]): q["block_table"] for r in snap["requests"] for q in r["seqs"]}
        tables = rebuilt
        prev = snap
    assert diffs > 5 and appends > 10


def test_a_different_block_count_sends_a_full_frame():
    a, b = kv_cache_state(make_scheduler(8)), kv_cache_state(make_scheduler(12))
    assert make_frame(a, b)["type"] == "full" and make_frame(None, a)["type"] == "full"
    assert make_frame(a, a)["states_changed"] == []


@pytest.mark.parametrize("seed", range(5))
def test_changes_are_the_runs_of_cells_that_differ(seed):
    """Against a plain per-cell comparison: runs at both ends, adjacent cells, one-cell runs."""
    rng = random.Random(seed)
    prev = "".join(rng.choice("fusc") for _ in range(1000))
    cur = list(prev)
    for i in [0, 999] + rng.sample(range(1000), 60):
        cur[i] = rng.choice([c for c in "fusc" if c != prev[i]])
    cur = "".join(cur)
    runs = _changes(prev, cur)
    want = [i for i in range(1000) if prev[i] != cur[i]]
    assert [start + k for start, run in runs for k in range(len(run))] == want
    assert all(run == cur[start:start + len(run)] for start, run in runs)
    assert all(a[0] + len(a[1]) < b[0] for a, b in zip(runs, runs[1:]))  # maximal runs: a gap between
    assert _changes(cur, cur) == [] and _changes("", "") == []


def test_public_state_lists_owners_per_block():
    sched, driver = _busy_scheduler()
    for _ in range(3):
        driver.step()
    snap = kv_cache_state(sched)
    out = public_state(snap)
    owners = block_owners(snap)
    assert [b["block"] for b in out["blocks"]] == list(range(24))
    for b in out["blocks"]:
        assert b["state"] == state_names(snap["states"])[b["block"]]
        assert b["owners"] == owners.get(b["block"], [])
        assert (b["state"] in ("used", "shared")) == bool(b["owners"])
        assert (b["state"] == "shared") == (len(b["owners"]) > 1)


def test_throttle_shares_one_snapshot_between_readers():
    calls = []

    async def take():
        calls.append(1)
        await asyncio.sleep(0.01)
        return {"n": len(calls)}

    async def main():
        feed = ThrottledSnapshot(take, min_interval=3600)
        got = await asyncio.gather(*(feed.get() for _ in range(5)))
        assert len(calls) == 1 and all(g is got[0] for g in got) and got[0]["version"] == 1
        feed.min_interval = feed.interval = 0
        again = await feed.get()
        assert len(calls) == 2 and again["version"] == 2
    asyncio.run(main())


def test_costly_snapshots_are_taken_less_often():
    async def take():
        return {"snapshot_s": 0.05}

    async def main():
        feed = ThrottledSnapshot(take, min_interval=0.25, budget=0.01)
        await feed.get()
        return feed.interval
    assert asyncio.run(main()) == pytest.approx(5.0)  # 50 ms at most 1% of the time


def test_the_default_budget_keeps_2hz_for_an_8ms_snapshot():
    async def take():
        return {"snapshot_s": 0.008}  # 65,536 blocks took ~5 ms on the H200's host

    async def main():
        feed = ThrottledSnapshot(take)
        await feed.get()
        return feed.interval
    assert asyncio.run(main()) <= 0.5


def test_a_reader_at_the_feeds_interval_gets_a_new_snapshot_every_tick(monkeypatch):
    """The snapshot's age counts from when it was asked for: a take that waits 40 ms for the engine
    thread, read every 0.5 s (the page's cadence, the feed's interval), is new at every tick, also
    when the timer fires a little early. Counted from its arrival, every other tick found it 'fresh'
    and the page got 1 frame per second instead of 2."""
    from pagedserve.dashboard import feed as feed_mod
    clock = [100.0]
    monkeypatch.setattr(feed_mod.time, "monotonic", lambda: clock[0])

    async def take():
        clock[0] += 0.04  # the engine thread answers after its current step
        return {"snapshot_s": 0.004}

    async def main():
        feed = ThrottledSnapshot(take, min_interval=0.5)
        versions = []
        for tick in range(6):
            clock[0] = 100.0 + 0.5 * tick - (0.001 if tick % 2 else 0.0)
            versions.append((await feed.get())["version"])
        return versions
    assert asyncio.run(main()) == [1, 2, 3, 4, 5, 6]


def test_a_reader_that_holds_the_latest_waits_for_the_next_instead_of_skipping(monkeypatch):
    """A tick late by 0.3 s (a busy event loop) and the next one on time, 0.2 s later: the feed
    may not take a new snapshot for another 0.025 s (interval 0.25, 10% slack). The reader that
    says which version it holds waits that long and gets a new one; one that does not, as before,
    gets the same snapshot again (its frame was skipped: every such tick cost the page a frame)."""
    from pagedserve.dashboard import feed as feed_mod
    clock = [100.0]
    monkeypatch.setattr(feed_mod.time, "monotonic", lambda: clock[0])

    async def fake_sleep(d):
        clock[0] += d
    monkeypatch.setattr(feed_mod.asyncio, "sleep", fake_sleep)

    async def take():
        return {"snapshot_s": 0.001}

    async def main():
        feed = ThrottledSnapshot(take, min_interval=0.25)
        assert (await feed.get())["version"] == 1
        clock[0] = 100.8   # late
        assert (await feed.get(newer_than=1, wait_up_to=0.5))["version"] == 2
        clock[0] = 101.0   # on time, 0.2 s later
        assert (await feed.get())["version"] == 2  # no version held: the latest, fresh enough
        assert (await feed.get(newer_than=2, wait_up_to=0.01))["version"] == 2  # none before the next tick
        new = await feed.get(newer_than=2, wait_up_to=0.5)
        assert new["version"] == 3 and clock[0] == pytest.approx(100.8 + 0.225)
    asyncio.run(main())


def test_one_slow_snapshot_slows_the_feed_for_a_while_not_for_its_whole_cost():
    """The budget weighs a running average of the cost: a 100 ms snapshot among 5 ms ones (the
    host busy elsewhere) spaces the next ones ~1.4 s apart, not 5 s, and 0.5 s again after 6."""
    costs = iter([0.005] * 3 + [0.1] + [0.005] * 6)

    async def take():
        return {"snapshot_s": next(costs)}

    async def main():
        feed = ThrottledSnapshot(take, min_interval=0)
        intervals = []
        for _ in range(10):
            feed._taken_at = float("-inf")  # due every time: only the interval it leaves counts
            await feed.get()
            intervals.append(feed.interval)
        return intervals
    intervals = asyncio.run(main())
    assert intervals[:3] == [pytest.approx(0.25)] * 3
    assert intervals[3] == pytest.approx((0.005 + 0.25 * 0.095) / 0.02) and intervals[3] < 1.5
    assert intervals[-1] <= 0.5 and intervals == sorted(intervals[:4]) + sorted(intervals[4:], reverse=True)


def test_stream_sends_full_then_diff_frames():
    sched, driver = _busy_scheduler()

    async def take():
        driver.step()  # the cache moves between two snapshots
        return kv_cache_state(sched)

    async def main():
        gen = sse_frames(ThrottledSnapshot(take, min_interval=0, budget=float("inf")), 0.0)
        frames = [json.loads((await gen.__anext__())[len(b"data: "):]) for _ in range(3)]
        await gen.aclose()
        return frames
    frames = asyncio.run(main())
    assert [f["type"] for f in frames] == ["full", "diff", "diff"]
    assert [f["version"] for f in frames] == [1, 2, 3]


@pytest.mark.parametrize("raw", ["0.1", "11", "fast", "nan"])
def test_interval_out_of_range_names_the_field(raw):
    with pytest.raises(ValueError, match="interval"):
        parse_interval(raw)
    assert parse_interval(None) == 0.4 and parse_interval("2") == 2.0


def _frame_times(monkeypatch, delay_on_wakeup, until: float) -> list[float]:
    """The (fake) clock times at which a 0.5 s stream sent its frames, up to `until` seconds, when
    the stream's k-th wake-up comes delay_on_wakeup(k) seconds late."""
    from pagedserve.dashboard import feed as feed_mod
    clock, wakeups = [0.0], [0]
    monkeypatch.setattr(feed_mod.time, "monotonic", lambda: clock[0])

    async def late_sleep(d):
        wakeups[0] += 1
        clock[0] += max(d, 0.0) + delay_on_wakeup(wakeups[0])
    monkeypatch.setattr(feed_mod.asyncio, "sleep", late_sleep)

    async def take():
        return {"snapshot_s": 0.001, "states": "f", "requests": []}

    async def main():
        gen = sse_frames(ThrottledSnapshot(take), 0.5)
        sent = []
        while clock[0] < until:
            if (await gen.__anext__()).startswith(b"data:"):
                sent.append(clock[0])
        await gen.aclose()
        return sent
    return asyncio.run(main())


def test_late_ticks_do_not_lower_the_stream_rate(monkeypatch):
    """Every third wake-up of the stream comes 0.8 s late (an event-loop stall longer than the
    interval, as under load on CPU): the ticks catch up with their grid, spaced as the feed allows,
    so 20 s at 0.5 s still bring 40 frames. When a tick more than an interval late restarted the
    grid from itself, this gave 32 (1.6 frames/s)."""
    from pagedserve.dashboard import feed as feed_mod
    sent = _frame_times(monkeypatch, lambda k: 0.8 if k % 3 == 0 else 0.0, until=20.0)
    assert len(sent) >= 40
    gaps = [b - a for a, b in zip(sent, sent[1:])]
    assert min(gaps) >= 0.25 * (1 - feed_mod.FRESHNESS_SLACK) - 1e-9


def test_a_long_stall_does_not_bring_a_burst_of_frames(monkeypatch):
    """A 3 s stall (more than an interval) is not made up for by frames sent back to back: the
    grid moves on, and the frames after it are spaced at least the feed's interval apart."""
    from pagedserve.dashboard import feed as feed_mod
    sent = _frame_times(monkeypatch, lambda k: 3.0 if k == 4 else 0.0, until=10.0)
    after = [t for t in sent if t > 3.0]
    assert all(b - a >= 0.25 * (1 - feed_mod.FRESHNESS_SLACK) - 1e-9 for a, b in zip(after, after[1:]))
    assert len(sent) <= 10.0 / 0.5 + 1
