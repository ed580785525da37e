#!/usr/bin/env python3
"""pagedserve beside vLLM on the same GPU machine: online serving and the offline workloads.

One command on the GPU machine, after vLLM 0.26 has been installed into $SITE (a --target dir;
it also supplies fastapi/uvicorn/pydantic/pyzmq/msgspec there):

    python3 benchmarks/serving/vs_vllm.py all --site $SITE

Phases (each also runs alone, so a run can be split across calls with a time limit):
  online   both OpenAI servers, Llama-3.1-8B dummy weights with an offline word-level tokenizer,
           max_model_len 4096, driven by `pagedserve bench serve` (streamed completions, token-id
           prompts, ignore_eos, Poisson arrivals), sharegpt-like, --num-requests at each rate;
           --saturation-fractions 0.3 0.6 0.9 picks the rates from a first vLLM run with every request
           at once (rates.json), --salt-rates gives each rate its own prompts (no cross-rate cache hits)
  offline  `nanovllm` and `fixed256`: benchmarks/serving/peers/bench_vllm.py beside
           `pagedserve bench throughput`, two timed runs each, the faster reported by both
  decode   (not in `all`) benchmarks/serving/peers/decode_step_diff.py for both engines at --decode-seqs:
           the period and kernels of one small-batch decode step, measured alike
  collect  merges the phase files into benchmarks/results/<device>/serving.json with the ratios
           tpot_p50_over_vllm_rN, ttft_p99_over_vllm_rN, throughput_over_vllm_rN,
           offline_nanovllm_over_vllm, offline_fixed256_over_vllm

--gpus 0,1 runs vLLM on the first GPU and pagedserve on the second at the same time (one machine,
one sitting, each engine alone on its GPU); --gpus 0 runs them one after the other. Every phase
writes its files and a progress log into --work (default $OUT, else a temp dir) as it goes.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from pagedserve.benchmark.results import ENV_SWITCHES  # noqa: E402
from pagedserve.benchmark.server_process import stop_process, wait_until_ready  # noqa: E402

ENV = {"PYTHONUNBUFFERED": "1", "NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
       "NVSHMEM_DISABLE_NVLS": "1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1", "HF_HUB_OFFLINE": "1",
       "TRANSFORMERS_OFFLINE": "1", "VLLM_USE_FLASHINFER_SAMPLER": "0", "TOKENIZERS_PARALLELISM": "false"}
PORTS = {"vllm": 8100, "pagedserve": 8200}
_log_lock = threading.Lock()


def log(work: Path, msg: str) -> None:
    line = f"[{time.strftime('%H:%M:%S')}] {msg}"
    with _log_lock:
        print(line, flush=True)
        with open(work / "progress.log", "a") as f:
            f.write(line + "\n")


def env_for(engine: str, site: str, gpu: str) -> dict:
    path = site if engine == "vllm" else f"{REPO}:{site}"
    return {**os.environ, **ENV, "PYTHONPATH": path, "CUDA_VISIBLE_DEVICES": gpu}


def wait_up(port: int, proc: subprocess.Popen, limit: float) -> bool:
    try:  # /v1/models: vLLM and pagedserve both answer it once the model is loaded
        wait_until_ready(proc, f"http://127.0.0.1:{port}/v1/models", limit, interval=1)
        return True
    except RuntimeError:
        return False


def serve_cmd(engine: str, model_dir: Path, port: int, max_len: int, extra: str) -> list[str]:
    if engine == "vllm":
        return [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", str(model_dir), "--load-format", "dummy",
                "--port", str(port), "--max-model-len", str(max_len), *shlex.split(extra)]
    return [sys.executable, "-m", "pagedserve.entrypoints.cli", "serve", str(model_dir), "--load-format", "dummy",
            "--port", str(port), "--max-model-len", str(max_len), *shlex.split(extra)]


def online_one(engine: str, gpu: str, args, model_dir: Path, work: Path) -> None:
    port = PORTS[engine]
    extra = args.vllm_args if engine == "vllm" else args.pagedserve_args
    server_log = open(work / f"{engine}_server.log", "w")
    t0 = time.monotonic()
    proc = subprocess.Popen(serve_cmd(engine, model_dir, port, args.max_model_len, extra),
                            env=env_for(engine, args.site, gpu), stdout=server_log, stderr=subprocess.STDOUT)
    info = {"engine": engine, "gpu": gpu, "server_args": extra, "num_requests": args.num_requests,
            "salt_rates": args.salt_rates, "max_arrival_seconds": args.max_arrival_seconds,
            # the server's environment switches, for collect (which may run later, elsewhere)
            "env_switches": {k: os.environ.get(k) for k in ENV_SWITCHES}}
    try:
        if not wait_up(port, proc, args.startup_limit):
            info["error"] = f"server did not start (rc={proc.poll()})"
            log(work, f"{engine}: {info['error']}")
            return
        info["startup_seconds"] = round(time.monotonic() - t0, 1)
        log(work, f"{engine} up after {info['startup_seconds']} s on GPU {gpu}")
        if args.saturation_fractions:
            if engine == "vllm":
                probe_rates(args, port, model_dir, work)
            elif not wait_for_rates(args, work):
                info["error"] = "no rates.json from vLLM's probe"
                log(work, f"{engine}: {info['error']}")
                return
        for i, rate in enumerate(args.rates):
            bench_serve(args, engine, port, rate, requests_at(args, rate), work / f"online_{engine}_r{rate:g}.json",
                        model_dir, work, salt=i + 1 if args.salt_rates else 0)
    finally:
        stop_process(proc)
        (work / f"online_{engine}_info.json").write_text(json.dumps(info, indent=1))


def requests_at(args, rate: float) -> int:
    """--num-requests, or fewer where --max-arrival-seconds caps a slow rate's arrivals (at least 60
    requests): the same count for both engines, as it follows the rate."""
    if not args.max_arrival_seconds:
        return args.num_requests
    return min(args.num_requests, max(60, round(rate * args.max_arrival_seconds)))


def bench_serve(args, engine: str, port: int, rate: float, num: int, out: Path, model_dir: Path, work: Path,
                salt: int = 0) -> None:
    cmd = [sys.executable, "-m", "pagedserve.entrypoints.cli", "bench", "serve",
           "--base-url", f"http://127.0.0.1:{port}/v1", "--workload", args.workload,
           "--num-requests", str(num), "--request-rate", str(rate), "--output", str(out),
           # vLLM's /v1/models reports no vocabulary size: both engines' ids come from the tokenizer
           "--tokenizer", str(model_dir), "--disable-tqdm", *(["--prompt-salt", str(salt)] if salt else []),
           # More than one: the client's own CPU off the measurement (one process is near a core at
           # 40 req/s on the H200's hosts: docs/benchmarks-history.md, single engine).
           "--num-client-processes", str(args.client_processes)]
    r = subprocess.run(cmd, env={**os.environ, **ENV, "PYTHONPATH": f"{REPO}:{args.site}"},
                       capture_output=True, text=True, timeout=args.rate_limit)
    tail = [ln for ln in r.stdout.splitlines() if any(k in ln for k in ("completed", "throughput", "TTFT", "TPOT"))]
    log(work, f"{engine} rate {rate:g} rc={r.returncode}: " + " | ".join(tail)[:400])
    if r.returncode != 0 and not out.exists():
        log(work, r.stderr[-1500:])


def saturation_req_s(requests: list[dict], upto: float = 0.1) -> float | None:
    """The request rate the engine sustains with the probe's N requests in flight: every request sent
    at once (rate inf), its output tokens per second until the first `upto` of them have finished
    (all N still, or nearly, decoding), over the mean output length. Each request's tokens are
    counted as spread evenly between its first token and its end. Neither the whole run's
    requests/s (it counts the tail, the last long outputs decoding almost alone) nor the slope of
    the completions (in a burst it follows the spread of the output lengths) says that."""
    ok = [r for r in requests if not r.get("error") and r.get("latency") and r.get("ttft") is not None
          and r.get("output_len")]
    if len(ok) < 10:
        return None
    t1 = sorted(r["sent_at"] + r["latency"] for r in ok)[max(0, int(upto * len(ok)) - 1)]
    if t1 <= 0:
        return None
    tokens = sum(r["output_len"] * min(1.0, max(0.0, (t1 - r["sent_at"] - r["ttft"]) / max(r["latency"] - r["ttft"], 1e-9)))
                 for r in ok)
    return tokens / t1 / (sum(r["output_len"] for r in ok) / len(ok))


def probe_rates(args, port: int, model_dir: Path, work: Path) -> None:
    """--saturation-fractions: vLLM's saturation from one run with every request at once (its own
    prompts: salt 1000), and the rates at those fractions of it, into work/rates.json and args.rates."""
    out = work / "online_vllm_probe.json"
    out.unlink(missing_ok=True)  # an earlier run's probe in the same --work is not this one
    bench_serve(args, "vllm", port, float("inf"), args.probe_requests or args.num_requests, out, model_dir, work,
                salt=1000)
    doc = _load(out) or {}
    sat = saturation_req_s(doc.get("results", doc).get("requests", []))
    if sat is None:  # both engines still run the same rates: --rates
        log(work, "probe: no saturation figure; keeping --rates")
    else:
        args.rates = [round(f * sat, 2) for f in args.saturation_fractions]
    (work / "rates.json").write_text(json.dumps({
        "saturation_req_s": round(sat, 3) if sat else None,
        "fractions": args.saturation_fractions if sat else None, "rates": args.rates,
        "probe": {"requests": args.probe_requests or args.num_requests, "request_rate": "inf",
                  "whole_run_req_s": doc.get("results", doc).get("request_throughput"),
                  "rule": "output tokens/s until 10% finished, over the mean output length (vs_vllm.saturation_req_s)"}},
        indent=1))
    log(work, f"probe: vLLM saturation {sat} req/s; rates {args.rates}")


def wait_for_rates(args, work: Path) -> bool:
    """pagedserve waits for vLLM's probe (concurrent on two GPUs; one after the other it is there).
    vLLM's info file is written when its phase ends: no rates by then, none will come."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < args.startup_limit + args.rate_limit:
        if (work / "rates.json").exists():
            args.rates = json.loads((work / "rates.json").read_text())["rates"]
            return True
        if (work / "online_vllm_info.json").exists():
            return False
        time.sleep(2)
    return False


def offline_one(engine: str, gpu: str, args, work: Path) -> None:
    for wl in args.workloads:
        out = work / f"offline_{engine}_{wl}.json"
        if engine == "vllm":
            cmd = [sys.executable, str(REPO / "benchmarks/serving/peers/bench_vllm.py"), "--workload", wl, "--repeat", "2",
                   "--out", str(out), "--repo-root", str(REPO)]
        else:
            cmd = [sys.executable, "-m", "pagedserve.entrypoints.cli", "bench", "throughput", "--workload", wl,
                   "--output", str(out), *shlex.split(args.pagedserve_offline_args)]
        t0 = time.monotonic()
        with open(work / f"offline_{engine}_{wl}.log", "w") as f:
            r = subprocess.run(cmd, env=env_for(engine, args.site, gpu), stdout=f, stderr=subprocess.STDOUT,
                               timeout=args.offline_limit)
        log(work, f"offline {engine} {wl} rc={r.returncode} in {time.monotonic() - t0:.0f} s")


def decode_one(engine: str, gpu: str, args, work: Path) -> None:
    """benchmarks/serving/peers/decode_step_diff.py at each --decode-seqs: one small-batch decode step of
    this engine, its period and its kernels (#13's TPOT gap at 10 and 20 req/s)."""
    env = env_for(engine, args.site, gpu)
    if engine == "vllm":
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # its core in this process, where the profiler looks
    # One engine for every batch size (vLLM starts in ~50 s): one process, a file per size.
    cmd = [sys.executable, str(REPO / "benchmarks/serving/peers/decode_step_diff.py"), "--engine", engine,
           "--num-seqs", *map(str, args.decode_seqs), "--config", str(Path(args.model) / "config.json"),
           "--out", str(work / f"decode_{engine}_n{{n}}.json")]
    t0 = time.monotonic()
    with open(work / f"decode_{engine}.log", "w") as f:
        r = subprocess.run(cmd, env=env, stdout=f, stderr=subprocess.STDOUT, timeout=args.offline_limit)
    periods = {n: (_load(work / f"decode_{engine}_n{n}.json") or {}).get("results", {}).get("step_period_ms")
               for n in args.decode_seqs}
    log(work, f"decode {engine} rc={r.returncode} in {time.monotonic() - t0:.0f} s: ms/step {json.dumps(periods)}")


def run_pair(fn, args, work: Path, *extra) -> None:
    gpus = args.gpus.split(",")
    engines = [e for e in ("vllm", "pagedserve") if e in args.engines.split(",")]
    if len(gpus) >= 2 and len(engines) == 2:
        ts = [threading.Thread(target=fn, args=(e, g, args, *extra, work)) for e, g in zip(engines, gpus)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
    else:
        for e in engines:
            fn(e, gpus[0], args, *extra, work)


def phase_online(args, work: Path) -> None:
    model_dir = work / "model"
    subprocess.run([sys.executable, str(REPO / "benchmarks/serving/peers/make_bench_model_dir.py"), args.model, str(model_dir)],
                   check=True, env={**os.environ, "PYTHONPATH": args.site})
    run_pair(online_one, args, work, model_dir)


def phase_offline(args, work: Path) -> None:
    run_pair(offline_one, args, work)


def _load(p: Path):
    return json.loads(p.read_text()) if p.exists() else None


def phase_collect(args, work: Path) -> None:
    from pagedserve.benchmark.results import write_result
    results: dict = {"online": {}, "offline": {}}
    ratios: dict = {}
    rates_file = _load(work / "rates.json")
    if rates_file:  # --saturation-fractions: the rates the probe chose
        args.rates = rates_file["rates"]
        results["saturation"] = rates_file
    for engine in ("vllm", "pagedserve"):
        info = _load(work / f"online_{engine}_info.json") or {}
        per_rate = {}
        for rate in args.rates:
            d = _load(work / f"online_{engine}_r{rate:g}.json")
            if d is None:
                continue
            d = d.get("results", d)  # bench serve writes through the result writer
            per_rate[f"r{rate:g}"] = {k: d[k] for k in ("completed", "failed", "request_throughput", "output_throughput",
                                                        "ttft_ms", "tpot_ms", "itl_ms", "e2e_latency_ms") if k in d}
        results["online"][engine] = {"startup_seconds": info.get("startup_seconds"), "server_args": info.get("server_args"),
                                     "gpu": info.get("gpu"), "error": info.get("error"), "note": info.get("note"),
                                     "rates": per_rate}
        for wl in args.workloads:
            d = _load(work / f"offline_{engine}_{wl}.json")
            if d is not None:
                results["offline"].setdefault(engine, {})[wl] = d.get("results", d)
    on = results["online"]
    for rate in args.rates:
        k = f"r{rate:g}"
        v, p = on["vllm"]["rates"].get(k), on["pagedserve"]["rates"].get(k)
        if not v or not p:
            continue
        ratios[f"tpot_p50_over_vllm_{k}"] = round(p["tpot_ms"]["p50"] / v["tpot_ms"]["p50"], 3)
        ratios[f"ttft_p99_over_vllm_{k}"] = round(p["ttft_ms"]["p99"] / v["ttft_ms"]["p99"], 3)
        ratios[f"throughput_over_vllm_{k}"] = round(p["request_throughput"] / v["request_throughput"], 3)
    pr = on["pagedserve"]["rates"]
    if len(pr) >= 2:  # cold start: the first rate's TTFT p99 against the later rates'
        first, *later = [pr[f"r{r:g}"]["ttft_ms"]["p99"] for r in args.rates if f"r{r:g}" in pr]
        ratios["pagedserve_first_rate_ttft_p99_over_later_max"] = round(first / max(later), 3)
    off = results["offline"]
    for wl, key in (("nanovllm", "output_tok_s"), ("fixed256", "req_s")):
        v, p = off.get("vllm", {}).get(wl), off.get("pagedserve", {}).get(wl)
        if v and p:
            ours = p.get("output_tokens_per_s") if wl == "nanovllm" else p.get("requests_per_s")
            ratios[f"offline_{wl}_over_vllm"] = round(ours / v[key], 3)
    # The decode phase's files, where it ran (into work/decode/ or work/): one small-batch step.
    for engine in ("vllm", "pagedserve"):
        for n in args.decode_seqs:
            d = _load(work / "decode" / f"decode_{engine}_n{n}.json") or _load(work / f"decode_{engine}_n{n}.json")
            if d is not None:
                results.setdefault("decode", {}).setdefault(engine, {})[f"n{n}"] = d.get("results", d)
    dec = results.get("decode", {})
    for n in args.decode_seqs:
        v, p = dec.get("vllm", {}).get(f"n{n}"), dec.get("pagedserve", {}).get(f"n{n}")
        if v and p and v.get("step_period_ms") and p.get("step_period_ms"):
            ratios[f"decode_step_period_n{n}_over_vllm"] = round(p["step_period_ms"] / v["step_period_ms"], 3)
    # As the online phase ran (its info files), where they say: collect may run later with defaults.
    ran = [_load(work / f"online_{e}_info.json") or {} for e in ("vllm", "pagedserve")]
    num_requests = next((i["num_requests"] for i in ran if "num_requests" in i), args.num_requests)
    salt_rates = next((i["salt_rates"] for i in ran if "salt_rates" in i), args.salt_rates)
    config = {"model": os.path.relpath(args.model, REPO), "workload": args.workload, "num_requests": num_requests,
              "rates": args.rates, "salt_rates": salt_rates,
              "max_model_len": args.max_model_len, "gpus": args.gpus,
              "placement": "concurrent, one engine per GPU" if len(args.gpus.split(",")) > 1 else "one after the other",
              "pagedserve_args": args.pagedserve_args, "pagedserve_offline_args": args.pagedserve_offline_args,
              "vllm_args": args.vllm_args}
    out = Path(args.output)
    from pagedserve.config import EngineConfig
    from pagedserve.benchmark.results import engine_switches
    switches = engine_switches(EngineConfig(async_scheduling="--no-async-scheduling" not in args.pagedserve_args))
    for unresolved in ("max_num_seqs", "max_num_batched_tokens"):  # the device decides (config.batch_defaults)
        if switches.get(unresolved) is None:
            switches.pop(unresolved, None)
    # Environment switches as the measured server saw them, not as this process does.
    ran_with = (_load(work / "online_pagedserve_info.json") or {}).get("env_switches")
    if ran_with is not None:
        switches.update(ran_with)
    # The code measured is what the phases ran; collect may run later, elsewhere.
    measured = {(_load(f) or {}).get("commit") for f in work.glob("o*_pagedserve_*.json")} - {None}
    # The GPU machine's host, as the phases' own result files recorded it (not this machine's).
    hosts = [(_load(f) or {}).get("host") for f in sorted(work.glob("o*_pagedserve_*.json"))]
    host = next((h for h in hosts if h), {"note": "not recorded by the phases (result files before host info)"})
    # The lease's day, as its phase files have it (the first, should the runs cross a midnight), not collect's.
    days = sorted({(_load(f) or {}).get("date") for f in work.glob("o*_*.json")} - {None})
    write_result(out, "serving_vs_vllm", "python benchmarks/serving/vs_vllm.py " + shlex.join(sys.argv[1:]), config,
                 results, {"vllm": "0.26.0"}, ratios, device=args.device, switches=switches,
                 measured_commit=measured.pop() if len(measured) == 1 else None, host=host,
                 date=days[0] if days else None)
    print(json.dumps(ratios, indent=1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("phase", choices=["online", "offline", "collect", "all", "decode"],
                    help="all = online, offline, collect; decode (alone): one small-batch decode step of "
                         "each engine through benchmarks/serving/peers/decode_step_diff.py")
    ap.add_argument("--site", default=os.environ.get("SITE", os.path.join(tempfile.gettempdir(), "site")),
                    help="where vLLM 0.26 and the server wheels were installed (default: $SITE or <tmp>/site)")
    ap.add_argument("--gpus", default="0", help="'0' (one after the other) or '0,1' (vLLM on 0, pagedserve on 1)")
    ap.add_argument("--work", default=os.environ.get("OUT") or tempfile.mkdtemp(), help="phase files and progress log")
    ap.add_argument("--model", default=str(REPO / "benchmarks/models/llama-3.1-8b"))
    ap.add_argument("--workload", default="sharegpt-like")
    ap.add_argument("--engines", default="vllm,pagedserve",
                    help="online/offline: which engines run ('pagedserve' alone: an A/B of our own flags; "
                         "collect still needs both engines' files for the ratios)")
    ap.add_argument("--rates", type=float, nargs="+", default=[10, 20, 40])
    ap.add_argument("--num-requests", type=int, default=300)
    ap.add_argument("--saturation-fractions", type=float, nargs="+", default=None,
                    help="online: first a vLLM run with every request at once (the probe), then --rates = these "
                         "fractions of its saturation (saturation_req_s), written to rates.json for both engines")
    ap.add_argument("--probe-requests", type=int, default=None, help="the probe's requests (default --num-requests)")
    ap.add_argument("--max-arrival-seconds", type=float, default=None,
                    help="online: a rate sends at most rate x this many requests (at least 60), so slow rates "
                         "of a slow model fit a device call")
    ap.add_argument("--salt-rates", action="store_true",
                    help="rate i sends its prompts with --prompt-salt i+1 (both engines alike), so no rate finds "
                         "another's prompts in the prefix cache")
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--workloads", nargs="+", default=["nanovllm", "fixed256"])
    ap.add_argument("--pagedserve-args", default="", help="extra flags for `pagedserve serve`")
    ap.add_argument("--pagedserve-offline-args", default="", help="extra flags for `pagedserve bench throughput`")
    ap.add_argument("--vllm-args", default="", help="extra flags for `vllm serve`")
    ap.add_argument("--startup-limit", type=float, default=420)
    ap.add_argument("--rate-limit", type=float, default=300)
    ap.add_argument("--client-processes", type=int, default=1, help="online: processes of the benchmark client")
    ap.add_argument("--offline-limit", type=float, default=420)
    ap.add_argument("--decode-seqs", type=int, nargs="+", default=[16, 32], help="decode: batch sizes")
    ap.add_argument("--output", default=str(REPO / "benchmarks/results/h200/serving.json"))
    ap.add_argument("--device", default=None, help="collect: the device the phases ran on (default: this one)")
    args = ap.parse_args()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    if args.phase in ("online", "all"):
        phase_online(args, work)
    if args.phase in ("offline", "all"):
        phase_offline(args, work)
    if args.phase in ("collect", "all"):
        phase_collect(args, work)
    if args.phase == "decode":
        run_pair(decode_one, args, work)


if __name__ == "__main__":
    main()
