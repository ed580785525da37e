"""TTFT and CPU per streamed token of the API server and the benchmark client, on CPU alone.

The real serving path without a model: `pagedserve serve`'s API server (build_app over
AsyncLLMEngine and MPCoreClient, under make_server) with the demo model's tokenizer, so outputs
are detokenized as in a served model, and an engine-core process running EngineCore's own busy
loop over pagedserve.benchmark.modelless_core (one token per running sequence every --step-ms).
The client is `pagedserve bench serve`'s run_benchmark: --num-requests token-id prompts at
Poisson --request-rate, streamed. What it asks: which process runs out of CPU first at the H200
serving runs' token rates (~12,500 tokens/s at 40 req/s), and what the server's lag does to TTFT.

--server-cpus pins the server and its core to those CPUs and --hogs starts that many busy loops
there: a server with a fraction of a core, as on a host that runs Python several times slower
(the H200 leases' hosts time a fixed loop at 8-14 ms, this CPU at ~5). --server-tree runs the
server from another checkout (`git archive BASE pagedserve | tar -x -C DIR`), alternating with
this tree for --rounds rounds, for a before/after.

    python benchmarks/serving/stream_cost.py --out stream_cost.json
    python benchmarks/serving/stream_cost.py --server-cpus 1 --client-cpus 0 --hogs 0 2 --server-tree /tmp/before \
        --rounds 2 --clients httpx aiohttp
"""
from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

def run_core(step_ms: float, rest: list[str]) -> int:
    from pagedserve.benchmark import modelless_core as mc
    args = mc.parse_args(["--step-ms", str(step_ms), *rest])
    return mc.serve(mc.make_engine(args), args.input, args.output, args.parent_pid)


def run_server(port: int, step_ms: float, tree: str | None) -> None:
    from transformers import AutoTokenizer

    from pagedserve.config import EngineConfig
    from pagedserve.engine import pauses
    from pagedserve.engine.async_engine import AsyncLLMEngine
    from pagedserve.engine.core_client import MPCoreClient
    from pagedserve.entrypoints.http_server import make_server
    from pagedserve.entrypoints.openai.api_server import build_app
    core = [sys.executable, __file__, "--role", "core", "--step-ms", str(step_ms),
            *(["--server-tree", tree] if tree else [])]
    tokenizer = AutoTokenizer.from_pretrained(str(ROOT / "pagedserve/demo_model"))
    engine = AsyncLLMEngine(MPCoreClient(EngineConfig(), core_cmd=core), tokenizer)
    app = build_app(engine, "bench")
    pauses.freeze_startup_heap()  # as run_single_server does
    pauses.set_serving_gc_thresholds()
    make_server(app, "127.0.0.1", port).run()


def one_run(args, tree: str | None) -> dict:
    from pagedserve.benchmark.server_process import process_cpu_seconds as cpu_seconds
    from pagedserve.benchmark.server_process import stop_process, wait_until_ready
    from pagedserve.entrypoints.bench_serve import run_benchmark
    from pagedserve.workloads import WorkloadRequest
    env = dict(os.environ, PYTHONPATH=f"{tree or ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    pin = ["taskset", "-c", args.server_cpus] if args.server_cpus else []
    server = subprocess.Popen([*pin, sys.executable, __file__, "--role", "server", "--port", str(args.port),
                               "--step-ms", str(args.step_ms), *(["--server-tree", tree] if tree else [])],
                              env=env, stdout=subprocess.DEVNULL)
    rng = random.Random(0)
    t, reqs = 0.0, []
    for i in range(args.num_requests):  # the same prompts and arrivals in every run
        reqs.append(WorkloadRequest(prompt_token_ids=[3 + (i * 7 + j) % 1000 for j in range(args.prompt_len)],
                                    output_len=args.output_len, arrival_time=t))
        t += rng.expovariate(args.request_rate)
    base = f"http://127.0.0.1:{args.port}"
    try:
        wait_until_ready(server, base + "/health", 120, interval=0.3)
        asyncio.run(run_benchmark(base + "/v1", reqs[:8], "bench"))  # warm-up
        cpu0, t0 = cpu_seconds(server.pid), time.monotonic()
        s = asyncio.run(run_benchmark(base + "/v1", reqs, "bench"))
        wall, server_cpu = time.monotonic() - t0, cpu_seconds(server.pid) - cpu0
    finally:
        stop_process(server)
    tokens = s["output_throughput"] * s["duration_s"]
    return {"tree": tree or "this", "failed": s["failed"], "tokens_per_s": round(tokens / wall),
            "ttft_ms": {k: round(s["ttft_ms"][k], 1) for k in ("p50", "p99")},
            "itl_ms_p90": round(s["itl_ms"]["p90"], 1), "tpot_ms_p50": round(s["tpot_ms"]["p50"], 2),
            "cpu_us_per_token": {"server": round(server_cpu / tokens * 1e6, 1),
                                 "client": round(s["client_cpu_s"] / tokens * 1e6, 1)}}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    ap.add_argument("--role", default="driver", choices=["driver", "server", "core"])
    ap.add_argument("--port", type=int, default=8377)
    ap.add_argument("--step-ms", type=float, default=6.8, help="the core's step (the H200's ~85-sequence decode step)")
    ap.add_argument("--num-requests", type=int, default=300)
    ap.add_argument("--request-rate", type=float, default=40.0)
    ap.add_argument("--output-len", type=int, default=350)
    ap.add_argument("--prompt-len", type=int, default=100)
    ap.add_argument("--server-cpus", default=None, help="taskset CPU list for the server and its core")
    ap.add_argument("--client-cpus", default=None, help="CPU list the client (this process) runs on")
    ap.add_argument("--hogs", type=int, nargs="+", default=[0],
                    help="busy loops pinned to --server-cpus meanwhile; several: one set of runs each")
    ap.add_argument("--server-tree", default=None, help="also run the server from this source tree (before/after)")
    ap.add_argument("--clients", nargs="+", default=[None], choices=["aiohttp", "httpx"],
                    help="the benchmark client's HTTP library (PAGEDSERVE_BENCH_CLIENT); several: runs of each")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--out", default=None)
    args, rest = ap.parse_known_args()
    if args.role == "core":
        if args.server_tree:
            sys.path.insert(0, args.server_tree)
        return run_core(args.step_ms, rest)
    if args.role == "server":
        if args.server_tree:
            sys.path.insert(0, args.server_tree)
        return run_server(args.port, args.step_ms, args.server_tree)
    if any(args.hogs) and not args.server_cpus:
        ap.error("--hogs needs --server-cpus")
    if args.client_cpus:
        os.sched_setaffinity(0, {int(c) for c in args.client_cpus.split(",")})
    tree = str(Path(args.server_tree).resolve()) if args.server_tree else None
    runs = []
    from pagedserve.entrypoints.bench_client import BENCH_CLIENT_ENV, bench_client
    for n in args.hogs:
        hogs = [subprocess.Popen(["taskset", "-c", args.server_cpus, sys.executable, "-c", "while True: pass"])
                for _ in range(n)]
        try:
            for _ in range(args.rounds):
                for client in args.clients:
                    if client:
                        os.environ[BENCH_CLIENT_ENV] = client
                    for t in ([tree] if tree else []) + [None]:
                        runs.append({"hogs": n, "client": bench_client(), **one_run(args, t)})
                        print(runs[-1], flush=True)
        finally:
            for h in hogs:
                h.kill()
    summary = {}
    for key in dict.fromkeys((r["hogs"], r["client"], r["tree"]) for r in runs):
        mine = [r for r in runs if (r["hogs"], r["client"], r["tree"]) == key]
        summary[f"hogs={key[0]} client={key[1]} tree={key[2]}"] = {
            "ttft_ms_p50": statistics.median(r["ttft_ms"]["p50"] for r in mine),
            "ttft_ms_p99": statistics.median(r["ttft_ms"]["p99"] for r in mine),
            "itl_ms_p90": statistics.median(r["itl_ms_p90"] for r in mine),
            "tokens_per_s": statistics.median(r["tokens_per_s"] for r in mine),
            "server_cpu_us_per_token": statistics.median(r["cpu_us_per_token"]["server"] for r in mine),
            "client_cpu_us_per_token": statistics.median(r["cpu_us_per_token"]["client"] for r in mine)}
    print(summary)
    if args.out:
        from pagedserve.benchmark.results import write_result
        config = {k: getattr(args, k) for k in ("step_ms", "num_requests", "request_rate", "output_len", "prompt_len",
                                                "server_cpus", "client_cpus", "hogs", "server_tree", "rounds", "clients")}
        write_result(args.out, "stream_cost", "python benchmarks/serving/stream_cost.py " + " ".join(sys.argv[1:]),
                     config, {"medians": summary, "runs": runs}, {}, {}, device="cpu")
    return 0


if __name__ == "__main__":
    sys.exit(main())
