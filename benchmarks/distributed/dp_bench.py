"""Data parallelism on two GPUs: DP=2 against DP=1 at saturation, through the OpenAI server.

Starts `pagedserve serve` twice (DP=1: the plain server on GPU 0; DP=2: the mp backend,
one replica per GPU, prefix routing), replays `sharegpt-like` against each with every
request sent at t=0 (`pagedserve bench serve`'s client, streamed), and stops it. Llama-3.1-8B
architecture, dummy weights, bf16. Writes benchmarks/results/h200x2/dp.json with
ratios.dp2_over_dp1_throughput (total tokens/s; target >= 1.9) and its output-token twin, and
beside them the output rate while requests still waited, without the drain at each run's end
(results.dpN.backlog; ratio dp2_over_dp1_backlog_output_throughput), and the rate at saturation
from the servers' own counters: the median (and mean) 1 s rate while every replica had a queue
(results.dpN.saturated; ratios dp2_over_dp1_saturated_{median,mean}_output_throughput).

Every child is bounded: server start-up by --start-timeout, each replay by --run-timeout.
Progress lines go to stdout and, when $OUT is set, to $OUT/dp_bench.log.

    python benchmarks/distributed/dp_bench.py                        # on a host with 2 GPUs
    python benchmarks/distributed/dp_bench.py --smoke --device cpu   # the same plumbing, demo config, CPU
    python benchmarks/distributed/dp_bench.py --api-server-counts 1,4   # DP=2 again with 4 front-end processes
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from pagedserve.benchmark.server_process import free_port, stop_process, wait_until_ready  # noqa: E402

LLAMA = ROOT / "benchmarks/models/llama-3.1-8b"


def log(msg: str) -> None:
    line = f"[dp_bench {time.strftime('%H:%M:%S')}] {msg}"
    print(line, flush=True)
    if os.environ.get("OUT"):
        with open(Path(os.environ["OUT"]) / "dp_bench.log", "a") as f:
            f.write(line + "\n")


def start_server(dp: int, args, log_path: Path, api_servers: int = 1) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd = [sys.executable, "-m", "pagedserve.entrypoints.cli", "serve", str(args.model),
           "--port", str(port), "--served-model-name", "bench", "--device", args.device,
           "--dtype", args.dtype, "--max-model-len", str(args.max_model_len),
           "--data-parallel-size", str(dp), "--load-format", "dummy", "--skip-tokenizer-init",
           *(["--api-server-count", str(api_servers)] if api_servers > 1 else []),
           *shlex.split(args.server_args)]
    env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
               TOKENIZERS_PARALLELISM="false")
    if dp == 1 and args.device != "cpu":
        env["CUDA_VISIBLE_DEVICES"] = env.get("CUDA_VISIBLE_DEVICES", "0,1").split(",")[0]
    log(f"DP={dp}: {shlex.join(cmd)}")
    proc = subprocess.Popen(cmd, stdout=open(log_path, "w"), stderr=subprocess.STDOUT, env=env,
                            cwd=ROOT, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        # A DP front answers 200 before every replica is up; {"status": "ok"} means all are.
        wait_until_ready(proc, base + "/health", args.start_timeout, interval=2, request_timeout=5,
                         ready=lambda r: dp == 1 or r.json().get("status") == "ok")
    except RuntimeError as e:
        stop_server(proc)
        raise RuntimeError(f"DP={dp}: {e}; see {log_path}") from None
    return proc, base


def front_end_facts(base: str) -> dict:
    """What the DP front end says of itself on /health (backend, relay client)."""
    import httpx
    h = httpx.get(base + "/health", timeout=10).json()
    return {k: h[k] for k in ("backend", "relay_client") if k in h}


def replica_totals(base: str) -> dict[str, dict[str, float]]:
    """Finished requests and generated tokens so far, per replica label of the merged /metrics
    ("-" for a plain server, which has no replica label)."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families
    out: dict[str, dict[str, float]] = {}
    wanted = {"pagedserve:e2e_request_latency_seconds_count": "requests",
              "pagedserve:generation_tokens_total": "output_tokens"}
    for family in text_string_to_metric_families(httpx.get(base + "/metrics", timeout=30).text):
        for sample in family.samples:
            if sample.name in wanted:
                per = out.setdefault(sample.labels.get("replica", "-"), {})
                per[wanted[sample.name]] = per.get(wanted[sample.name], 0.0) + sample.value
    return out


def stop_server(proc: subprocess.Popen) -> None:
    stop_process(proc, timeout=60, group=True)


def _children(pid: int) -> list[int]:
    out: list[int] = []
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                out += [int(x) for x in f.read().split()]
    except OSError:
        pass
    return out


def _cpu_seconds(pid: int) -> float | None:
    from pagedserve.benchmark.server_process import process_cpu_seconds
    try:
        return process_cpu_seconds(pid)
    except OSError:
        return None


def server_processes(proc: subprocess.Popen, dp: int) -> dict[str, int]:
    """label -> pid of the server's Python processes: DP=1 the API server and its engine
    core; DP>1 the front end, each replica's API server and each replica's engine core."""
    def python_children(pid: int) -> list[int]:
        keep = []
        for c in _children(pid):
            try:
                cmd = open(f"/proc/{c}/cmdline", "rb").read()
            except OSError:
                continue
            if b"python" in cmd and b"resource_tracker" not in cmd:
                keep.append(c)
        return keep
    if dp == 1:
        return {"api_server": proc.pid,
                **{f"engine_core{i or ''}": c for i, c in enumerate(python_children(proc.pid))}}
    out = {"frontend": proc.pid}
    children = python_children(proc.pid)
    relays = [c for c in children if b"relay_worker" in open(f"/proc/{c}/cmdline", "rb").read()]
    for k, c in enumerate(relays):
        out[f"frontend{k + 1}"] = c
    for i, r in enumerate(c for c in children if c not in relays):
        out[f"replica{i}_api_server"] = r
        for j, c in enumerate(python_children(r)):
            out[f"replica{i}_engine_core{j or ''}"] = c
    return out


def queue_depths(base: str) -> dict[str, dict[str, float]]:
    """Running and waiting requests now, and tokens generated so far, per replica label of the
    merged /metrics."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families
    out: dict[str, dict[str, float]] = {}
    wanted = {"pagedserve:num_requests_running": "running", "pagedserve:num_requests_waiting": "waiting",
              "pagedserve:generation_tokens_total": "output_tokens"}
    for family in text_string_to_metric_families(httpx.get(base + "/metrics", timeout=10).text):
        for sample in family.samples:
            if sample.name in wanted:
                out.setdefault(sample.labels.get("replica", "-"), {})[wanted[sample.name]] = sample.value
    return out


class Timeline:
    """Once a second during the measured run: each server process's CPU share over the last
    second (1.0 = one core) and each replica's running / waiting requests. It says whether a
    process sat at one core while requests waited, and whether a replica ran dry, which the
    whole run's averages cannot."""

    def __init__(self, base: str, pids: dict[str, int], period_s: float = 1.0) -> None:
        self.base, self.pids, self.period_s = base, pids, period_s
        self.samples: list[dict] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> "Timeline":
        self._t0 = time.monotonic()
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=30)

    def _run(self) -> None:
        last = {k: _cpu_seconds(p) for k, p in self.pids.items()}
        last_t = time.monotonic()
        while not self._stop.wait(self.period_s):
            now = time.monotonic()
            cpu = {k: _cpu_seconds(p) for k, p in self.pids.items()}
            share = {k: round((cpu[k] - last[k]) / (now - last_t), 2) for k in cpu
                     if cpu[k] is not None and last[k] is not None}
            last, last_t = cpu, now
            try:
                depths = queue_depths(self.base)
            except Exception as e:  # a slow /metrics must not end the sampling
                depths = {"error": repr(e)[:200]}
            # The counters were read during the query: stamp them with its midpoint.
            t_metrics = (now + time.monotonic()) / 2 - self._t0
            self.samples.append({"t": round(now - self._t0, 2), "t_metrics": round(t_metrics, 3),
                                 "cpu_share": share, "requests": depths})

    def share_until(self, t_end: float) -> dict[str, float]:
        """Each process's mean CPU share over the samples up to t_end (s from the start)."""
        rows = [r["cpu_share"] for r in self.samples if r["t"] <= t_end]
        keys = {k for r in rows for k in r}
        return {k: round(sum(r.get(k, 0.0) for r in rows) / len(rows), 3) for k in sorted(keys)} if rows else {}


def saturated_rate(samples: list[dict]) -> dict | None:
    """Generated tokens per second while every replica had requests waiting: the rate at
    saturation, from the servers' own counters in the timeline's samples.

    Each pair of consecutive samples at which every replica (the same set in both) had a
    queue gives one rate (all replicas' tokens over the interval). The median of those is the
    steady rate: the first seconds' burst of prompts (every replica prefilling its first full
    batch at once, about the same seconds at DP=1 and DP=2, so a larger share of DP=2's
    shorter run) and the drain at the end (nobody waits) do not enter it. The client's clock
    does not either: a client process that falls behind reading its streams delays its
    timestamps, not the counters. The mean over the same intervals is beside it."""
    rates, weights = [], []
    for a, b in zip(samples, samples[1:]):
        ra, rb = a.get("requests") or {}, b.get("requests") or {}
        if not ra or "error" in ra or "error" in rb or set(ra) != set(rb):
            continue
        if not all(r.get("waiting", 0) > 0 for r in (*ra.values(), *rb.values())):
            continue
        if any("output_tokens" not in r for r in (*ra.values(), *rb.values())):
            continue
        dt = b["t_metrics"] - a["t_metrics"]
        if dt <= 0:
            continue
        rates.append(sum(rb[k]["output_tokens"] - ra[k]["output_tokens"] for k in ra) / dt)
        weights.append(dt)
    if not rates:
        return None
    return {"intervals": len(rates), "seconds": round(sum(weights), 2),
            "median_output_throughput": statistics.median(rates),
            "mean_output_throughput": sum(r * w for r, w in zip(rates, weights)) / sum(weights)}


def replay(base: str, args, pids: dict[str, int] | None = None) -> dict:
    from pagedserve.entrypoints.bench_serve import run_benchmark
    from pagedserve.workloads import make_workload
    warm = make_workload(args.workload, num_requests=8, seed=99)
    reqs = make_workload(args.workload, num_requests=args.num_requests, seed=args.seed)
    for r in reqs + warm:
        r.arrival_time = 0.0  # saturation: everything queued at once
        if args.smoke:  # the demo model: 2048-token vocabulary, short context
            r.prompt_token_ids = [3 + t % 2000 for t in r.prompt_token_ids[:200]]
            r.output_len = min(r.output_len, 48)

    deadline = time.monotonic() + args.run_timeout
    asyncio.run(asyncio.wait_for(run_benchmark(base + "/v1", warm, model="bench"), args.run_timeout))
    before = {k: _cpu_seconds(p) for k, p in (pids or {}).items()}
    totals_before = replica_totals(base)
    with Timeline(base, pids or {}) as timeline:
        summary = asyncio.run(asyncio.wait_for(
            run_benchmark(base + "/v1", reqs, model="bench", num_processes=args.num_client_processes,
                          max_concurrency=args.max_concurrency),
            max(1.0, deadline - time.monotonic())))
    summary["timeline"] = timeline.samples
    summary["saturated"] = saturated_rate(timeline.samples)
    if summary.get("backlog"):  # while requests still waited: was some process at one core?
        summary["server_cpu_share_backlog"] = timeline.share_until(summary["backlog"]["window_s"])
    # Each server process's CPU over the measured run: near 1 core (share 1.0) means that
    # process set the pace (one event loop, one core).
    spent = {k: (_cpu_seconds(p), before[k]) for k, p in (pids or {}).items()}
    summary["server_cpu_s"] = {k: round(a - b, 2) for k, (a, b) in spent.items()
                               if a is not None and b is not None}
    summary["server_cpu_share"] = {k: round(v / summary["duration_s"], 3)
                                   for k, v in summary["server_cpu_s"].items()}
    # How the measured requests split over the replicas (an uneven split caps the DP ratio).
    totals_after = replica_totals(base)
    summary["per_replica"] = {rep: {k: int(v - totals_before.get(rep, {}).get(k, 0.0)) for k, v in t.items()}
                              for rep, t in sorted(totals_after.items())}
    errors = [r["error"] for r in summary.pop("requests") if r["error"]]
    summary["first_error"] = errors[0] if errors else None
    return summary


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results/h200x2/dp.json"))
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default=None, help="default: bfloat16 (float32 with --smoke)")
    ap.add_argument("--workload", default="sharegpt-like")
    ap.add_argument("--num-requests", type=int, default=None, help="default 3000 (8 with --smoke): enough that the run's length is set by "
                    "throughput, not by its slowest requests (at 1000 on 2xH200, DP=1 took 29.2 s with "
                    "an e2e p99 of 27.0 s)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-model-len", type=int, default=None, help="default 4096 (512 with --smoke)")
    ap.add_argument("--server-args", default="", help="extra `pagedserve serve` flags for both runs")
    ap.add_argument("--start-timeout", type=float, default=300.0)
    ap.add_argument("--run-timeout", type=float, default=240.0)
    ap.add_argument("--num-client-processes", type=int, default=1,
                    help="split the requests over K client processes (one asyncio process "
                         "parses ~10-20k SSE events/s at most); percentiles come from the "
                         "merged per-request records, throughput from the union's wall time")
    ap.add_argument("--max-concurrency", type=int, default=None,
                    help="at most this many requests in flight (default: all of them); above both "
                         "replicas' max_num_seqs the engines stay saturated while fewer streams stay open")
    ap.add_argument("--api-server-counts", default="1",
                    help="comma-separated: one DP=2 run per count of front-end processes "
                         "(--api-server-count); results dp2 for the first, dp2_api<K> for the others")
    ap.add_argument("--smoke", action="store_true", help="demo config, few requests: the plumbing")
    args = ap.parse_args()
    if args.num_client_processes < 1:
        ap.error("--num-client-processes must be >= 1")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        ap.error("--max-concurrency must be >= 1")
    args.dtype = args.dtype or ("float32" if args.smoke else "bfloat16")
    args.num_requests = args.num_requests or (8 if args.smoke else 3000)
    args.max_model_len = args.max_model_len or (512 if args.smoke else 4096)
    if args.smoke:
        from pagedserve.demo_model import DEMO_MODEL_DIR
        args.model = DEMO_MODEL_DIR
        args.server_args = args.server_args or "--num-gpu-blocks-override 512 --swap-space 0.05"
    else:
        args.model = LLAMA

    from pagedserve.benchmark.results import write_result
    out_dir = Path(os.environ.get("OUT") or "/tmp")
    results = {}
    counts = [int(k) for k in args.api_server_counts.split(",")]
    runs = [("dp1", 1, 1)] + [("dp2" if i == 0 else f"dp2_api{k}", 2, k) for i, k in enumerate(counts)]
    for key, dp, api_servers in runs:
        proc, base = start_server(dp, args, out_dir / f"{key}_server.log", api_servers)
        try:
            log(f"{key}: replaying {args.num_requests} {args.workload} requests at t=0")
            pids = server_processes(proc, dp)
            log(f"{key}: server processes {pids}")
            results[key] = replay(base, args, pids)
            s = results[key]
            s["api_server_count"] = api_servers
            if dp > 1:
                s["front_end"] = front_end_facts(base)
            if s["failed"]:
                log(f"{key}: first error: {s['first_error']}")
            log(f"{key}: {s['completed']} done, {s['failed']} failed in {s['duration_s']:.1f} s, "
                f"{s['total_token_throughput']:.0f} tok/s total, {s['output_throughput']:.0f} out tok/s; "
                f"client CPU {s['client_cpu_s']:.1f} s over {s['num_client_processes']} process(es); "
                f"server CPU share (cores) {s['server_cpu_share']}, while requests waited "
                f"{s.get('server_cpu_share_backlog')}; while every replica had a queue {s['saturated']}")
        finally:
            stop_server(proc)
    ratios = {
        "dp2_over_dp1_throughput": round(results["dp2"]["total_token_throughput"]
                                         / results["dp1"]["total_token_throughput"], 3),
        "dp2_over_dp1_output_throughput": round(results["dp2"]["output_throughput"]
                                                / results["dp1"]["output_throughput"], 3),
    }
    # A diagnostic beside the target's ratio, not instead of it: the output rate while requests
    # still waited (bench_stats.backlog_throughput), i.e. without each run's drain at the end.
    if results["dp1"].get("backlog") and results["dp2"].get("backlog"):
        ratios["dp2_over_dp1_backlog_output_throughput"] = round(
            results["dp2"]["backlog"]["output_throughput"] / results["dp1"]["backlog"]["output_throughput"], 3)
    # The "at saturation": each run's steady rate while every replica had a queue, from
    # the servers' counters (saturated_rate), beside the whole-run ratio above.
    if results["dp1"].get("saturated") and results["dp2"].get("saturated"):
        for stat in ("median", "mean"):
            ratios[f"dp2_over_dp1_saturated_{stat}_output_throughput"] = round(
                results["dp2"]["saturated"][f"{stat}_output_throughput"]
                / results["dp1"]["saturated"][f"{stat}_output_throughput"], 3)
    for key in results:  # the other front-end process counts, beside the first
        if key.startswith("dp2_api"):
            ratios[f"{key}_over_dp1_throughput"] = round(
                results[key]["total_token_throughput"] / results["dp1"]["total_token_throughput"], 3)
    config = {"model": str(Path(args.model).relative_to(ROOT)) if not args.smoke else "demo",
              "load_format": "dummy", "dtype": args.dtype,
              "workload": args.workload, "num_requests": args.num_requests, "arrivals": "all at t=0",
              "max_concurrency": args.max_concurrency,
              "max_model_len": args.max_model_len, "dp1": "plain server, GPU 0",
              "dp2": "--data-parallel-size 2 (mp backend, prefix routing), GPUs 0 and 1",
              "api_server_counts": counts,
              "server_args": args.server_args, "smoke": args.smoke,
              "num_client_processes": args.num_client_processes}
    doc = write_result(args.out, "dp", "python benchmarks/distributed/dp_bench.py " + shlex.join(sys.argv[1:]),
                       config, results, {}, ratios)
    log(json.dumps(doc["ratios"]))
    if any(r["failed"] for r in results.values()):
        log("some requests failed: see results.*.failed")
        sys.exit(1)


if __name__ == "__main__":
    main()
