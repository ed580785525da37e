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

--step-ms sets who is the bottleneck: at 80 ms (1024 sequences a step, 12.8k tokens/s at most)
the API server keeps up; at 20 ms the core outruns it and its output messages queue up.
CPU per output token of each process is reported too (what it would cost on a core of its own).

    git archive BASE pagedserve | tar -x -C /tmp/before   # a before/after, alternating rounds
    python benchmarks/dashboard/dashboard_latency.py --num-requests 3000 --output-len 100 --step-ms 80 \
        --rounds 2 --baseline-tree /tmp/before --out benchmarks/results/cpu/dashboard_latency.json
BENCH_GC_THRESHOLD=700,10,10 sets the API server's collector thresholds after start-up (an
experiment: CPython's defaults, where the tree sets its own).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from dashboard_stamps import breakdown, instrument_core, instrument_server  # noqa: E402  (this folder)

KEY = "sk-dashboard-latency"
mono = time.monotonic


def run_core(args, rest: list[str]) -> None:
    from pagedserve.benchmark import modelless_core as mc
    args = mc.parse_args(["--step-ms", str(args.step_ms), "--num-blocks", str(args.num_blocks),
                          "--max-num-seqs", str(args.max_num_seqs), *rest])
    engine = mc.make_engine(args)
    mc.serve(engine, args.input, args.output, args.parent_pid, wrap_output=instrument_core(engine))


def run_server(args) -> None:
    import uvicorn

    from pagedserve.config import EngineConfig
    from pagedserve.engine import pauses
    from pagedserve.engine.async_engine import AsyncLLMEngine
    from pagedserve.engine.core_client import MPCoreClient
    from pagedserve.entrypoints.openai.api_server import build_app
    core = [sys.executable, __file__, "--role", "core", "--step-ms", str(args.step_ms),
            "--num-blocks", str(args.num_blocks), "--max-num-seqs", str(args.max_num_seqs), *_tree(args)]
    engine = AsyncLLMEngine(MPCoreClient(EngineConfig(), core_cmd=core), None)
    routes = instrument_server(engine)  # before build_app: the feed takes the wrapped call
    app = build_app(engine, "bench", api_key=KEY)
    app.include_router(routes)
    pauses.freeze_startup_heap()  # as run_server_cli does
    if hasattr(pauses, "set_serving_gc_thresholds"):  # as run_server_cli does, where the tree has it
        pauses.set_serving_gc_thresholds()
    if os.environ.get("BENCH_GC_THRESHOLD"):  # an experiment: "700,10,10" is CPython's default
        import gc
        gc.set_threshold(*map(int, os.environ["BENCH_GC_THRESHOLD"].split(",")))
    uvicorn.run(app, host="127.0.0.1", port=args.port, log_level="warning", timeout_keep_alive=5)


def run_viewer(url: str) -> None:
    """Reads the stream as the page does (parses every frame); prints [version, arrival] as each
    frame arrives, so what it saw survives however it is stopped (a SIGINT inside httpx's read
    was once lost, and the viewer read on for a minute)."""
    try:
        with httpx.stream("GET", url, headers={"Authorization": f"Bearer {KEY}"}, timeout=None) as r:
            for line in r.iter_lines():
                if line.startswith("data:"):
                    print(json.dumps([json.loads(line[5:])["version"], mono()]), flush=True)
    except (KeyboardInterrupt, httpx.HTTPError):
        pass


def stop_viewer(viewer: subprocess.Popen) -> list[list]:
    """SIGINT, else SIGKILL after 10 s; the [version, arrival] lines it printed."""
    viewer.send_signal(signal.SIGINT)
    try:
        out = viewer.communicate(timeout=10)[0]
    except subprocess.TimeoutExpired:
        viewer.kill()
        out = viewer.communicate()[0]
    return [json.loads(line) for line in out.splitlines() if line.startswith("[")]


def _tree(args) -> list[str]:
    return ["--server-tree", args.server_tree] if args.server_tree else []


def _spawn(role: list[str]) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    return subprocess.Popen([sys.executable, __file__, *role], env=env, stdout=subprocess.PIPE, text=True)


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
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--baseline-tree", default=None,
                   help="also run server and core from this source tree, alternating with this one "
                        "(`git archive REV pagedserve | tar -x -C DIR`); the client stays this tree's")
    p.add_argument("--server-tree", default=None, help=argparse.SUPPRESS)  # the roles' copy of it
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

    runs: dict[str, list[dict]] = {"this": []}
    trees = [("this", None)]
    if args.baseline_tree:
        runs["baseline"] = []
        trees = [("baseline", str(Path(args.baseline_tree).resolve())), ("this", None)]
    for i in range(args.rounds):
        for name, tree in trees if i % 2 == 0 else trees[::-1]:  # alternate: drift hits both alike
            r = one_run(args, tree)
            runs[name].append(r)
            print(name, json.dumps({k: v for k, v in r.items() if k != "breakdown_ms"}), flush=True)

    if any("total" not in r["breakdown_ms"] for rs in runs.values() for r in rs):
        raise SystemExit("a round ended before the viewer timed any frame: give it more work "
                         "(--num-requests, --output-len or --step-ms)")

    def med(rs: list[dict], f) -> float:
        return round(statistics.median(f(r) for r in rs), 3)
    result = {name: {"frames_per_s": med(rs, lambda r: r["frames_per_s"]),
                     "output_tok_s": med(rs, lambda r: r["output_tok_s"]),
                     "server_cpu_us_per_token": med(rs, lambda r: r["cpu_us_per_token"]["server"]),
                     "frame_total_ms_median": med(rs, lambda r: r["breakdown_ms"]["total"]["median"]),
                     "runs": rs} for name, rs in runs.items()}
    print(json.dumps({n: {k: v for k, v in r.items() if k != "runs"} for n, r in result.items()}, indent=1))
    if args.out:
        from pagedserve.benchmark.results import write_result
        config = {k: getattr(args, k) for k in ("num_requests", "prompt_len", "output_len", "step_ms", "num_blocks",
                                                "max_num_seqs", "interval", "rounds", "baseline_tree")}
        config["BENCH_GC_THRESHOLD"] = os.environ.get("BENCH_GC_THRESHOLD")
        ratios = {"viewer_hz": result["this"]["frames_per_s"]}
        if "baseline" in result:
            ratios["viewer_hz_baseline"] = result["baseline"]["frames_per_s"]
        write_result(args.out, "dashboard_latency", "python " + " ".join(sys.argv), config, result, {}, ratios,
                     device="cpu")
    return 0


def one_run(args, tree: str | None) -> dict:
    """One server (its pagedserve from `tree`, else this one), the streams, the viewer; the figures."""
    from pagedserve.benchmark.server_process import process_cpu_seconds as cpu_seconds
    from pagedserve.benchmark.server_process import stop_process, wait_until_ready
    from pagedserve.entrypoints.bench_serve import run_benchmark
    from pagedserve.workloads import WorkloadRequest
    base = f"http://127.0.0.1:{args.port}"
    server = _spawn(["--role", "server", "--port", str(args.port), "--step-ms", str(args.step_ms),
                     "--num-blocks", str(args.num_blocks), "--max-num-seqs", str(args.max_num_seqs),
                     *(["--server-tree", tree] if tree else [])])
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
        seen = stop_viewer(viewer)
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
    return result


if __name__ == "__main__":
    sys.exit(main())
