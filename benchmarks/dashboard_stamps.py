"""The stamps benchmarks/dashboard_latency.py puts on each snapshot's way (see its docstring).

All by wrapping, nothing in pagedserve changes: the core's sockets and the model-less engine's
snapshot hook in the core process; the client's flush, decoder and output reads, the feed's
take, make_frame, json and sleep in the API server. time.monotonic() is CLOCK_MONOTONIC, one
clock for every process on the host, so stamps from both processes compare.
"""
from __future__ import annotations

import asyncio
import gc
import json
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
