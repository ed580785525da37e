"""Where a dashboard frame's time goes under heavy streaming: on CPU, without a model (issue #17).

The real API server (build_app, AsyncLLMEngine, MPCoreClient, under uvicorn) over an engine-core
process running EngineCore's own busy loop around pagedserve.benchmark.modelless_core (the real
Scheduler and KV manager, one token per running sequence per step, each step at least
--step-ms). The benchmark client streams --num-requests requests, all sent at t=0, while a
viewer process reads /kv_cache/events. Every snapshot is stamped on its way (one monotonic
clock for all processes on Linux), and each frame's time is split into:

  flush     the utility call queued in the API server until its message is sent
  core_wait sent until the core's loop takes it (the step in progress ends)
  snapshot  taking the snapshot (engine thread)
  core_rest the rest of that core iteration: the step, then encoding and sending its message
  queued    sent by the core until the API server's output task reads the message
  decode    msgspec decode of that message
  wake      future resolved until the SSE generator runs again
  frame     make_frame, then json: encoding the frame; write: yielded until the viewer has it

    python benchmarks/dashboard_latency.py --num-requests 1000 --output-len 100 --step-ms 20
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from dashboard_stamps import instrument_core, instrument_server  # noqa: E402  (this folder)

KEY = "sk-dashboard-latency"
mono = time.monotonic


def cpu_seconds(pid: int) -> float:
    """user + system CPU time of a process, from /proc/PID/stat."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def run_core(args, rest: list[str]) -> None:
    from pagedserve.benchmark import modelless_core as mc
    args = mc.parse_args(["--step-ms", str(args.step_ms), "--num-blocks", str(args.num_blocks),
                          "--max-num-seqs", str(args.max_num_seqs), *rest])
    engine = mc.make_engine(args)
    mc.serve(engine, args.input, args.output, wrap_output=instrument_core(engine))


def run_server(args) -> None:
    import uvicorn

    from pagedserve.config import EngineConfig
    from pagedserve.engine.async_engine import AsyncLLMEngine
    from pagedserve.engine.core_client import MPCoreClient
    from pagedserve.engine import pauses
    from pagedserve.engine.pauses import freeze_startup_heap
    from pagedserve.entrypoints.openai.api_server import build_app
    core = [sys.executable, __file__, "--role", "core", "--step-ms", str(args.step_ms),
            "--num-blocks", str(args.num_blocks), "--max-num-seqs", str(args.max_num_seqs), *_tree(args)]
    engine = AsyncLLMEngine(MPCoreClient(EngineConfig(), core_cmd=core), None)
    routes = instrument_server(engine)  # before build_app: the feed takes the wrapped call
    app = build_app(engine, "bench", api_key=KEY)
    app.include_router(routes)
    freeze_startup_heap()  # as run_server_cli does
    if hasattr(pauses, "set_serving_gc_thresholds"):  # as run_server_cli does, where the tree has it
        pauses.set_serving_gc_thresholds()
    if os.environ.get("BENCH_GC_THRESHOLD"):  # an experiment: "700,10,10" is CPython's default
        import gc
        gc.set_threshold(*map(int, os.environ["BENCH_GC_THRESHOLD"].split(",")))
    uvicorn.run(app, host="127.0.0.1", port=args.port, log_level="warning", timeout_keep_alive=5)


def run_viewer(url: str) -> None:
    """Reads the stream as the page does (parses every frame); prints (version, arrival) pairs."""
    got = []
    try:
        with httpx.stream("GET", url, headers={"Authorization": f"Bearer {KEY}"}, timeout=None) as r:
            for line in r.iter_lines():
                if line.startswith("data:"):
                    got.append((json.loads(line[5:])["version"], mono()))
    except KeyboardInterrupt:
        pass
    print(json.dumps(got), flush=True)


def _tree(args) -> list[str]:
    return ["--server-tree", args.server_tree] if args.server_tree else []


def _spawn(role: list[str]) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    return subprocess.Popen([sys.executable, __file__, *role], env=env, stdout=subprocess.PIPE, text=True)


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


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)  # --output is the core's
    p.add_argument("--role", default="driver", choices=["driver", "server", "core", "viewer"])
    p.add_argument("--num-requests", type=int, default=1000)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=100)
    p.add_argument("--step-ms", type=float, default=20.0)
    p.add_argument("--num-blocks", type=int, default=65536)
    p.add_argument("--max-num-seqs", type=int, default=1024)
    p.add_argument("--interval", type=float, default=0.5)
    p.add_argument("--port", type=int, default=18931)
    p.add_argument("--url", default=None)
    p.add_argument("--out", default=None, help="write the result JSON here (through the result writer)")
    p.add_argument("--server-tree", default=None,
                   help="server and core import pagedserve from this source tree (a before/after: "
                        "`git archive REV pagedserve | tar -x -C DIR`); the client stays this tree's")
    args, rest = p.parse_known_args()
    if args.server_tree:
        args.server_tree = str(Path(args.server_tree).resolve())
        if args.role != "driver":
            sys.path.insert(0, args.server_tree)
    if args.role == "core":
        return run_core(args, rest)
    if args.role == "server":
        return run_server(args)
    if args.role == "viewer":
        return run_viewer(args.url)

    from pagedserve.benchmark.server_process import stop_process, wait_until_ready
    from pagedserve.entrypoints.bench_serve import run_benchmark
    from pagedserve.workloads import WorkloadRequest
    base = f"http://127.0.0.1:{args.port}"
    server = _spawn(["--role", "server", "--port", str(args.port), "--step-ms", str(args.step_ms),
                     "--num-blocks", str(args.num_blocks), "--max-num-seqs", str(args.max_num_seqs),
                     *_tree(args)])
    reqs = [WorkloadRequest(prompt_token_ids=[3 + (i * 7 + j) % 1000 for j in range(args.prompt_len)],
                            output_len=args.output_len, arrival_time=0.0) for i in range(args.num_requests)]
    try:
        wait_until_ready(server, base + "/health", 120, interval=0.3)
        asyncio.run(run_benchmark(base + "/v1", reqs[:16], "bench", api_key=KEY))  # warm-up
        core_pid = httpx.get(base + "/bench/timings", timeout=60).json()["core_pid"]
        httpx.post(base + "/bench/reset")
        core_cpu0 = cpu_seconds(core_pid)
        viewer = _spawn(["--role", "viewer", "--url", f"{base}/kv_cache/events?interval={args.interval}"])
        time.sleep(2.0)  # its first (full) frame, before the load
        t0 = mono()
        summary = asyncio.run(run_benchmark(base + "/v1", reqs, "bench", api_key=KEY))
        t1 = mono()
        core_cpu = cpu_seconds(core_pid) - core_cpu0
        viewer.send_signal(signal.SIGINT)
        seen = json.loads(viewer.communicate(timeout=60)[0].strip().splitlines()[-1])
        timings = httpx.get(base + "/bench/timings", timeout=60).json()
    finally:
        stop_process(server)
    in_run = [v for v, t in seen if t0 <= t <= t1]
    tokens = summary["output_throughput"] * summary["duration_s"]
    result = {"frames_per_s": round(len(in_run) / (t1 - t0), 3), "frames": len(in_run),
              "duration_s": round(t1 - t0, 2), "output_tok_s": round(summary["output_throughput"]),
              "failed": summary["failed"],
              # CPU per output token: what each process would cost on a machine of its own.
              "cpu_us_per_token": {"server": round(timings["server_cpu_s"] / tokens * 1e6, 1),
                                   "core": round(core_cpu / tokens * 1e6, 1),
                                   "client": round(summary["client_cpu_s"] / tokens * 1e6, 1)},
              "breakdown_ms": breakdown(timings, seen, t0, t1)}
    print(json.dumps(result, indent=1))
    if args.out:
        from pagedserve.benchmark.results import write_result
        config = {k: getattr(args, k) for k in ("num_requests", "prompt_len", "output_len", "step_ms",
                                                "num_blocks", "max_num_seqs", "interval", "server_tree")}
        write_result(args.out, "dashboard_latency", "python " + " ".join(sys.argv), config, result, {},
                     {"viewer_hz": result["frames_per_s"]}, device="cpu")
    return 0


if __name__ == "__main__":
    sys.exit(main())
