"""The stamps benchmarks/dashboard/dashboard_latency.py puts on each snapshot's way (see its docstring),
and what they add up to (breakdown).

All by wrapping, nothing in pagedserve changes: the core's sockets and the model-less engine's
snapshot hook in the core process; the client's flush, decoder and output reads, the feed's
take, make_frame, json and sleep in the API server. time.monotonic() is CLOCK_MONOTONIC, one
clock for every process on the host, so stamps from both processes compare.
"""
from __future__ import annotations

import asyncio
import gc
import json
import math
import statistics
import time
from typing import Any

mono = time.monotonic


def instrument_core(engine: Any):
    """Stamps in the core: when its loop last took an input message, the snapshot's span, when
    the message carrying it was sent. Each snapshot carries the send times of the earlier ones."""
    st = {"got": 0.0, "seq": 0, "pending": None, "sent": [], "gc_ms": 0.0, "gc_full": 0, "gc_t0": 0.0}

    def on_gc(phase: str, info: dict) -> None:  # the core's collections, reported with each snapshot
        if phase == "start":
            st["gc_t0"] = mono()
        else:
            st["gc_ms"] += (mono() - st["gc_t0"]) * 1e3
            st["gc_full"] += info.get("generation") == 2
    gc.callbacks.append(on_gc)

    def on_snapshot(state: dict) -> None:
        end = mono()
        st["seq"] += 1
        state["_bench"] = {"seq": st["seq"], "got": st["got"], "start": end - state["snapshot_s"],
                           "end": end, "sent": st["sent"], "gc_ms": st["gc_ms"], "gc_full": st["gc_full"]}
        st["sent"], st["pending"] = [], st["seq"]
    engine.hooks.append(on_snapshot)

    class Out:
        def __init__(self, sock: Any) -> None:
            self.sock = sock

        def send(self, data: Any, *a: Any, **kw: Any) -> Any:
            if st["pending"] is not None:
                st["sent"].append((st["pending"], mono()))
                st["pending"] = None
            return self.sock.send(data, *a, **kw)

    import zmq
    real_recv = zmq.Socket.recv

    def recv(self, *a: Any, **kw: Any) -> Any:  # the core's input socket: its only recv
        frame = real_recv(self, *a, **kw)
        st["got"] = mono()
        return frame
    zmq.Socket.recv = recv
    return Out


def instrument_server(engine: Any):
    """Wrap the API server's side; returns a router with POST /bench/reset, GET /bench/timings."""
    from fastapi import APIRouter

    import pagedserve.dashboard.feed as feed
    from pagedserve.engine.core_messages import UtilityCall
    client = engine.client
    t: dict[str, Any] = {}
    cur: dict[str, Any] = {"rec": None, "decoded": {}, "by_version": {}, "last_return": None, "probe": None,
                           "cpu0": time.process_time()}

    def reset() -> None:
        t.update(frames=[], sent={}, sleep_late=[], loop_lag=[], dispatch=[], outputs_per_message=[],
                 ticks=[], gc=[], reads=[])
    reset()

    take = engine.get_kv_cache_state

    async def timed_take() -> dict:
        rec = cur["rec"] = {"call": mono()}
        state = await take()
        rec["resumed"] = mono()
        b = state["_bench"]
        rec.update(seq=b["seq"], core_got=b["got"], snap_start=b["start"], snap_end=b["end"],
                   core_gc_ms=b["gc_ms"], core_gc_full=b["gc_full"])
        rec.update(cur["decoded"].pop(b["seq"], {}))
        for seq, ts in b["sent"]:
            t["sent"][seq] = ts
        cur["rec"] = None
        t["frames"].append(rec)
        cur["by_version"][id(state)] = rec
        return state
    engine.get_kv_cache_state = timed_take

    flush = client._flush

    def timed_flush() -> None:
        rec = cur["rec"]
        if rec is not None and "flush" not in rec and any(isinstance(op, UtilityCall) for op in client._ops):
            rec["flush"] = mono()
        flush()
    client._flush = timed_flush

    class Decoder:  # the message (the whole of it, or its head where the client reads ahead)
        def __init__(self, real: Any) -> None:
            self.real = real

        def decode(self, buf: Any) -> Any:
            t0 = mono()
            msg = self.real.decode(buf)
            t1 = mono()
            if isinstance(msg.outputs, list):
                t["outputs_per_message"].append(len(msg.outputs))
            for r in msg.utility_results:
                if isinstance(r.result, dict) and "_bench" in r.result:
                    cur["decoded"][r.result["_bench"]["seq"]] = {"recv": t0, "decoded": t1}
            return msg

    class OutputsDecoder:
        def __init__(self, real: Any) -> None:
            self.real = real

        def decode(self, buf: Any) -> Any:
            outs = self.real.decode(buf)
            t["outputs_per_message"].append(len(outs))
            return outs
    codec = client._codec
    if hasattr(codec, "step_head"):
        codec.step_head = Decoder(codec.step_head)
        codec.step_outputs = OutputsDecoder(codec.step_outputs)
    else:  # a tree from before the client read ahead
        codec.step = Decoder(codec.step)

    get = client.get_output_async

    async def timed_get() -> Any:
        if cur["last_return"] is not None:  # how long the previous message took to hand out
            t["dispatch"].append(mono() - cur["last_return"])
        turned = []  # the loop ran other callbacks while this read waited, or it did not
        asyncio.get_running_loop().call_soon(turned.append, True)
        out = await get()
        cur["last_return"] = mono()
        t["reads"].append((cur["last_return"], bool(turned)))
        return out
    client.get_output_async = timed_get

    get_snapshot = feed.ThrottledSnapshot.get

    async def timed_get_snapshot(self: Any, *a: Any, **kw: Any) -> dict:  # every reader's tick
        t0 = mono()  # (asked, answered, version, throttle)
        snap = await get_snapshot(self, *a, **kw)
        t["ticks"].append((t0, mono(), snap["version"], self.interval))
        return snap
    feed.ThrottledSnapshot.get = timed_get_snapshot

    def rec_of(snapshot: dict) -> dict:
        rec = cur["by_version"].get(id(snapshot), {})
        rec["version"] = snapshot["version"]
        return rec

    make_frame = feed.make_frame

    def timed_make_frame(prev: Any, snapshot: dict) -> dict:
        rec = rec_of(snapshot)
        rec["frame0"] = mono()
        frame = make_frame(prev, snapshot)
        rec["frame1"] = mono()
        frame["_rec"] = rec  # for the json stamp below; removed there
        return frame
    feed.make_frame = timed_make_frame

    class Json:
        @staticmethod
        def dumps(obj: Any, **kw: Any) -> str:
            rec = obj.pop("_rec", None) if isinstance(obj, dict) else None
            t0 = mono()
            s = json.dumps(obj, **kw)
            if rec is not None:
                rec.update(json0=t0, json1=mono(), json_bytes=len(s))
            return s
    feed.json = Json

    class Asyncio:
        def __getattr__(self, name: str) -> Any:
            return getattr(asyncio, name)

        @staticmethod
        async def sleep(d: float) -> None:
            t0 = mono()
            await asyncio.sleep(d)
            t["sleep_late"].append(mono() - t0 - max(d, 0.0))
    feed.asyncio = Asyncio()

    async def probe() -> None:  # how late a 10 ms timer runs: the loop's iteration length
        while True:
            t0 = mono()
            await asyncio.sleep(0.01)
            t["loop_lag"].append((t0, mono() - t0 - 0.01))

    started: dict[int, float] = {}

    def on_gc(phase: str, info: dict) -> None:  # collections: (start, ms, generation)
        gen = info.get("generation", -1)
        if phase == "start":
            started[gen] = mono()
        elif gen in started:
            t0 = started.pop(gen)
            t["gc"].append((t0, (mono() - t0) * 1e3, gen))
    gc.callbacks.append(on_gc)

    router = APIRouter()

    @router.post("/bench/reset")
    async def bench_reset() -> dict:
        reset()
        cur["cpu0"] = time.process_time()
        if cur["probe"] is None:
            cur["probe"] = asyncio.get_running_loop().create_task(probe())
        return {}

    @router.get("/bench/timings")
    async def bench_timings() -> dict:
        frames = []
        for rec in t["frames"]:
            if rec.get("seq") in t["sent"]:
                rec = dict(rec, sent=t["sent"][rec["seq"]])
            frames.append(rec)
        return dict(t, frames=frames, sent=None, server_cpu_s=time.process_time() - cur["cpu0"],
                    core_pid=client.pid, gc_stats=gc.get_stats(), gc_threshold=gc.get_threshold(),
                    gc_tracked=len(gc.get_objects()))
    return router


# ---- what the stamps add up to -----------------------------------------------------------

def _stats(xs: list[float]) -> dict:
    xs = sorted(xs)
    if not xs:
        return {}
    return {"n": len(xs), "median": round(statistics.median(xs), 2),
            "p90": round(xs[math.ceil(0.9 * len(xs)) - 1], 2), "max": round(xs[-1], 2)}


def breakdown(timings: dict, seen: list, t0: float, t1: float) -> dict:
    """Per-frame segments in ms over the frames the viewer got while the streams ran."""
    arrived = dict(seen)
    segs: dict[str, list[float]] = {}
    for rec in timings["frames"]:
        v = rec.get("version")
        if v not in arrived or not t0 <= arrived[v] <= t1 or "sent" not in rec:
            continue
        marks = [("flush", "call", "flush"), ("core_wait", "flush", "core_got"),
                 ("snapshot", "snap_start", "snap_end"), ("core_rest", "snap_end", "sent"),
                 ("queued", "sent", "recv"), ("decode", "recv", "decoded"), ("wake", "decoded", "resumed"),
                 ("make_frame", "frame0", "frame1"), ("json", "json0", "json1")]
        rec = dict(rec, viewer=arrived[v])
        marks += [("write", "json1", "viewer"), ("total", "call", "viewer")]
        for name, a, b in marks:
            segs.setdefault(name, []).append((rec[b] - rec[a]) * 1e3)
    out = {k: _stats(v) for k, v in segs.items()}
    # The core's collections while the streams ran (cumulative counters carried by the snapshots).
    core = [r for r in timings["frames"] if "core_gc_ms" in r and t0 <= r["call"] <= t1]
    if len(core) > 1:
        out["core_gc"] = {"total_ms": round(core[-1]["core_gc_ms"] - core[0]["core_gc_ms"]),
                          "full": core[-1]["core_gc_full"] - core[0]["core_gc_full"]}
    out["sleep_late_ms"] = _stats([x * 1e3 for x in timings["sleep_late"]])
    out["loop_lag_ms"] = _stats([x * 1e3 for a, x in timings["loop_lag"] if t0 <= a <= t1])
    out["loop_stalls_over_100ms"] = [(round(a - t0, 2), round(x * 1e3)) for a, x in timings["loop_lag"]
                                     if t0 <= a <= t1 and x > 0.1]
    gcs = [g for g in timings["gc"] if t0 <= g[0] <= t1]
    out["gc"] = {"n": len(gcs), "total_ms": round(sum(g[1] for g in gcs)), "threshold": timings["gc_threshold"],
                 "full": sum(g[2] == 2 for g in gcs), "tracked_at_end": timings["gc_tracked"],
                 "over_50ms": [(round(a - t0, 2), round(ms), gen) for a, ms, gen in gcs if ms > 50]}
    out["dispatch_ms_per_message"] = _stats([x * 1e3 for x in timings["dispatch"]])
    out["outputs_per_message"] = _stats(timings["outputs_per_message"])
    # Runs of output messages the dispatch task read back to back without letting the loop turn.
    runs, n = [], 0
    for ts, turned in timings["reads"]:
        if t0 <= ts <= t1:
            n = 0 if turned else n + 1
            runs.append(n)
    out["messages_read_without_yielding"] = {"reads": len(runs), "without_yield": sum(r > 0 for r in runs),
                                             "longest_run": max(runs, default=0)}
    # The SSE reader's ticks while the streams ran: those that found no new snapshot sent nothing.
    ticks = [tk for tk in timings["ticks"] if t0 <= tk[0] <= t1]
    stale = [i for i in range(1, len(ticks)) if ticks[i][2] == ticks[i - 1][2]]
    out["ticks"] = {"n": len(ticks), "per_s": round(len(ticks) / (t1 - t0), 3), "no_new_snapshot": len(stale),
                    "gap_ms": _stats([(ticks[i][0] - ticks[i - 1][0]) * 1e3 for i in range(1, len(ticks))]),
                    "throttle_ms": _stats([tk[3] * 1e3 for tk in ticks])}
    return out
