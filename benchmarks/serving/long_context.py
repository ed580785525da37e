#!/usr/bin/env python3
"""Long contexts beside vLLM (#35): 8k, 32k and 100k-token prompts, a mix of long and short
requests, and the running decodes' TPOT while a 100k prompt prefills; both OpenAI servers on the
same GPU, one after the other (one device call each: a call lasts 10 minutes).

    python3 benchmarks/serving/long_context.py online --engines vllm --site $SITE --work $OUT/lc
    python3 benchmarks/serving/long_context.py online --engines pagedserve --site $SITE --work $OUT/lc
    python3 benchmarks/serving/long_context.py collect --work DIR       # here or there
    python3 benchmarks/serving/long_context.py prefill --out F.json     # offline: start-up + long prefills
    python3 benchmarks/serving/long_context.py replay --prefill-lens 32768 100000 --cost-scales 2
                                                       # CPU: the scheduler's chunks beside decodes
    python3 benchmarks/serving/long_context.py gaps --work DIR --scenario mix
                                                       # the records' inter-token gaps, classed

Each engine serves Llama-3.1-8B (benchmarks/models/llama-3.1-8b: llama3 RoPE to 131072) with dummy
weights and the offline word-level tokenizer (peers/make_bench_model_dir.py) at max_model_len
131072, with its own defaults otherwise (chunked prefill; --pagedserve-args / --vllm-args add
flags, e.g. --pagedserve-args "--cudagraph-mode full"). Scenarios, each a client run of streamed
completions with token-id prompts, ignore_eos, 256 output tokens unless said (Poisson arrivals):
  len8k     --n8k prompts of 8192 tokens at --rate8k req/s
  len32k    --n32k prompts of 32768 tokens at --rate32k
  len100k   --n100k prompts of 100000 tokens at --rate100k
  mix       short requests (sharegpt-like lengths) at --mix-short-rate for --mix-seconds, and 32k
            prompts at --mix-long-rate over the same time: the short ones' TPOT and TTFT are kept
  prefill100k  --prefill-decodes short requests (128-token prompts, --decode-output-len 1024 output
            tokens) sent at once,
            then one 100k prompt 5 s later: the short ones' inter-token gaps while it prefills
            (from its send to its first token), and before it
Prompts are fresh random ids, each scenario's its own (no prefix-cache hits). collect writes
benchmarks/results/h200/long_context.json with ratios <metric>_over_vllm_<scenario> for tpot_p50,
tpot_p99, ttft_p50, ttft_p99 and throughput (total tokens/s) at 8k, 32k, 100k and mix_short, and
decode_itl_p50/p99_during_100k_prefill_over_vllm; below 1 is better except for throughput; start-up
seconds of both servers (launch to /v1/models answering) are recorded beside them. Beside the
targets' ratios, two that a stream's chunking does not move: decode_gap_matched_over_vllm_<scenario>
(decode gaps outside long prefills, class for class by what was decoding) and
first_token_ready_p50_over_vllm_<scenario> (TTFT less the coalesced tokens at the request's median
gap: an estimate), and tpot_from_ready_p50/p99_over_vllm_<scenario> (the TPOT counted from that
estimated ready time).
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import vs_vllm as vv  # noqa: E402  (the servers' start, environment and readiness, shared)

REPO = vv.REPO
SCENARIOS = ("len8k", "len32k", "len100k", "mix", "prefill100k")
LENGTHS = {"len8k": 8192, "len32k": 32768, "len100k": 100_000}
SHORT_MAX_PROMPT = 4096  # mix: short prompts are cut below this
OUTPUT_LEN = 256
VOCAB_DRAW = 10000


# --- the requests ---------------------------------------------------------------------------------
def scenario_requests(name: str, args, seed: int = 0, vocab_size: int | None = None) -> list:
    """The scenario's WorkloadRequests with arrival times, drawn the same for both engines (token
    ids below 10000, or below vocab_size when smaller). Each scenario draws its prompts from its
    own stream: with one stream for all (before this was fixed, the 2026-12-02 run) len32k's first
    prompt began with len8k's, len100k's with len32k's, and mix's 32k prompts were len32k's, so
    later scenarios found prefixes cached (in both engines)."""
    from pagedserve.workloads import WorkloadRequest, make_workload
    rng = random.Random(f"{seed}:{name}")
    draw = min(VOCAB_DRAW, vocab_size or VOCAB_DRAW)

    def req(prompt_len: int, output_len: int, at: float, scaled: bool = True) -> WorkloadRequest:
        if scaled:
            prompt_len = max(1, round(prompt_len * args.prompt_scale))
        return WorkloadRequest([rng.randrange(draw) for _ in range(prompt_len)], output_len, at)

    def poisson(n: int, rate: float, start: float = 0.0) -> list[float]:
        arng, t, out = random.Random(seed + 1 + int(rate * 1000)), start, []
        for _ in range(n):
            t += arng.expovariate(rate)
            out.append(t)
        return out

    if name in LENGTHS:
        n, rate = {"len8k": (args.n8k, args.rate8k), "len32k": (args.n32k, args.rate32k),
                   "len100k": (args.n100k, args.rate100k)}[name]
        # The first request at t=0: the run starts with work, not with an idle wait.
        return [req(LENGTHS[name], OUTPUT_LEN, t) for t in [0.0] + poisson(n - 1, rate)]
    if name == "mix":
        n_short = max(1, int(args.mix_short_rate * args.mix_seconds))
        shorts = make_workload("sharegpt-like", n_short, request_rate=args.mix_short_rate, seed=seed,
                               vocab_size=vocab_size)
        short_cap = max(1, min(SHORT_MAX_PROMPT, round(32768 * args.prompt_scale)) - 1)
        for r in shorts:
            r.prompt_token_ids = r.prompt_token_ids[:short_cap]
            r.output_len = min(r.output_len, OUTPUT_LEN)
        n_long = max(1, int(args.mix_long_rate * args.mix_seconds))
        longs = [req(32768, OUTPUT_LEN, t) for t in poisson(n_long, args.mix_long_rate)]
        return sorted(shorts + longs, key=lambda r: r.arrival_time)
    if name == "prefill100k":
        shorts = [req(128, args.decode_output_len, 0.0, scaled=False) for _ in range(args.prefill_decodes)]
        return shorts + [req(100_000, 16, 5.0)]
    raise ValueError(f"scenario must be one of {SCENARIOS}, got {name!r}")


def run_client(args) -> None:
    """One scenario against the server at --port (the online phase runs this in a subprocess whose
    path has the client's packages)."""
    import httpx

    from pagedserve.entrypoints.bench_serve import fetch_served_model, run_benchmark
    base = f"http://127.0.0.1:{args.port}/v1"

    async def served_model():
        async with httpx.AsyncClient(timeout=httpx.Timeout(30.0)) as c:
            return await fetch_served_model(c, base, {}, None)
    served = asyncio.run(served_model())
    # vLLM's model card has no vocab_size: ids below 10000 then, valid for Llama-3.1's 128256.
    reqs = scenario_requests(args.scenario, args, vocab_size=served.vocab_size)
    summary = asyncio.run(run_benchmark(base, reqs, served.id, timeout=args.rate_limit, keep_itl=True))
    summary["scenario"] = args.scenario
    Path(args.out).write_text(json.dumps(summary))


# --- online: one server, every scenario -----------------------------------------------------------
def online_one(engine: str, args, model_dir: Path, work: Path) -> None:
    port = vv.PORTS[engine]
    extra = args.vllm_args if engine == "vllm" else args.pagedserve_args
    t0 = time.monotonic()
    with open(work / f"lc_{engine}_server.log", "w") as server_log:
        proc = subprocess.Popen(vv.serve_cmd(engine, model_dir, port, args.max_model_len, extra),
                                env=vv.env_for(engine, args.site, args.gpu), stdout=server_log,
                                stderr=subprocess.STDOUT)
    info = {"engine": engine, "server_args": extra, "max_model_len": args.max_model_len,
            "env_switches": {k: os.environ.get(k) for k in vv.ENV_SWITCHES}, **_measured_code()}
    try:
        if not vv.wait_up(port, proc, args.startup_limit):
            info["error"] = f"server did not start (rc={proc.poll()})"
            vv.log(work, f"{engine}: {info['error']}")
            return
        info["startup_seconds"] = round(time.monotonic() - t0, 1)
        vv.log(work, f"{engine} up after {info['startup_seconds']} s")
        for scenario in args.scenarios:
            out = work / f"lc_{engine}_{scenario}.json"
            cmd = [sys.executable, str(Path(__file__).resolve()), "client", "--scenario", scenario,
                   "--port", str(port), "--out", str(out), *_scenario_flags(args)]
            t1 = time.monotonic()
            try:
                r = subprocess.run(cmd, env={**os.environ, **vv.ENV, "PYTHONPATH": f"{REPO}:{args.site}"},
                                   capture_output=True, text=True, timeout=args.rate_limit + 30)
                rc, err = r.returncode, r.stderr[-1200:]
            except subprocess.TimeoutExpired:
                rc, err = "timeout", ""
            brief = _brief(_load(out), scenario) if out.exists() else err
            vv.log(work, f"{engine} {scenario} rc={rc} in {time.monotonic() - t1:.0f} s: {brief}")
    finally:
        vv.stop_process(proc)
        (work / f"lc_{engine}_info.json").write_text(json.dumps(info, indent=1))


def _measured_code() -> dict:
    """The pagedserve commit and host the online phase ran on (collect may run elsewhere, later)."""
    from pagedserve.benchmark.results import UnknownCommitError, git_commit, host_info
    try:
        commit = git_commit()
    except UnknownCommitError as e:
        commit = None
        print(f"commit unknown: {e}", file=sys.stderr)
    return {"commit": commit, "host": host_info()}


def _scenario_flags(args) -> list[str]:
    keys = ("n8k", "rate8k", "n32k", "rate32k", "n100k", "rate100k", "mix_short_rate", "mix_long_rate",
            "mix_seconds", "prefill_decodes", "decode_output_len", "rate_limit", "prompt_scale")
    return [x for k in keys for x in (f"--{k.replace('_', '-')}", str(getattr(args, k)))]


def phase_online(args, work: Path) -> None:
    model_dir = work / "model"
    if not (model_dir / "tokenizer.json").exists():
        subprocess.run([sys.executable, str(HERE / "peers/make_bench_model_dir.py"), args.model, str(model_dir)],
                       check=True, env={**os.environ, "PYTHONPATH": args.site})
    for engine in args.engines.split(","):
        online_one(engine, args, model_dir, work)


# --- collect --------------------------------------------------------------------------------------
def _load(p: Path):
    return json.loads(p.read_text()) if p.exists() else None


def _pct(values: list[float], q: float) -> float | None:
    import numpy as np
    return round(float(np.percentile(values, q)), 2) if values else None


def _tpot_ms(r: dict) -> float | None:
    if r.get("error") or r.get("ttft") is None or r["output_len"] < 2:
        return None
    return 1000 * (r["latency"] - r["ttft"]) / (r["output_len"] - 1)


def _coalesced(r: dict) -> int:
    """Output tokens that came in a streamed chunk with another one (tokens past one a chunk)."""
    return r["output_len"] - 1 - len(r.get("itl") or [])


def gap_classes(summary: dict, kept: list[dict]) -> dict[str, list[float]]:
    """The kept requests' inter-token gaps (ms) outside every long prompt's prefill (send to first
    token of a request of 8,192+ tokens), classed by how many long and how many short requests
    (short by 4s, 12+ together) were decoding at the gap's middle: a decode step's time by its mix,
    where a TPOT mixes steps of every kind and a coalescing stream drops its first gaps."""
    spans = [(r["sent_at"], r["sent_at"] + r["ttft"], r["sent_at"] + r["latency"], r["prompt_len"] >= 8192)
             for r in summary["requests"] if not r.get("error") and r.get("ttft") is not None]
    classes: dict[str, list[float]] = {}
    for r in kept:
        t = r["sent_at"] + r["ttft"]
        for g in r.get("itl") or []:
            mid, t = t + g / 2, t + g
            if any(long_ and sent <= mid < first for sent, first, _, long_ in spans):
                continue  # inside a long prompt's prefill
            longs = sum(long_ and first <= mid < end for _, first, end, long_ in spans)
            shorts = sum(not long_ and first <= mid < end for _, first, end, long_ in spans)
            classes.setdefault(f"long{longs}_short{min(shorts // 4 * 4, 12)}+", []).append(1e3 * g)
    return classes


def matched_gap_ratio(ours: dict, theirs: dict, min_gaps: int = 20) -> float | None:
    """One engine's decode gaps against the other's, step mix for step mix: the geometric mean of the
    per-class median ratios (classes with min_gaps+ gaps in both), each weighted by the smaller count."""
    import math
    pairs = [(min(a["n"], b["n"]), a["median_ms"] / b["median_ms"]) for k, a in ours.items()
             if (b := theirs.get(k)) and min(a["n"], b["n"]) >= min_gaps]
    if not pairs:
        return None
    return round(math.exp(sum(n * math.log(x) for n, x in pairs) / sum(n for n, _ in pairs)), 3)


def stats(summary: dict, keep=lambda r: True) -> dict:
    """TPOT/TTFT percentiles (ms) and throughput of the kept requests of one run; beside them, what
    separates a stream's pacing from the engine's: the coalesced tokens, the decode gaps outside
    long prefills, and each first token's estimated ready time."""
    reqs = [r for r in summary["requests"] if keep(r)]
    ok = [r for r in reqs if not r.get("error")]
    tpot = [t for t in map(_tpot_ms, ok) if t is not None]
    ttft = [1000 * r["ttft"] for r in ok if r.get("ttft") is not None]
    tokens = sum(r["prompt_len"] + r["output_len"] for r in ok)
    dur = summary["duration_s"]
    # A server whose first chunk carries several tokens has counted their decode steps into its TTFT
    # and out of its TPOT (vLLM 0.26 at long prompts: docs/long-context.md). first_token_ready takes
    # them back out, each at the request's own median gap: an estimate, not a measurement.
    # tpot_from_ready counts each request's decode from that estimated time: what its TPOT would be
    # had the stream sent every token as it came.
    streamed = [r for r in ok if r.get("ttft") is not None]
    coalesced = [_coalesced(r) for r in streamed]
    paced = [r for r in streamed if r.get("itl")]
    ready = [1000 * _ready_s(r) for r in paced]
    tpot_ready = [1000 * (r["latency"] - _ready_s(r)) / (r["output_len"] - 1) for r in paced]
    gaps = {k: {"n": len(v), "median_ms": round(_median(v), 2)}
            for k, v in sorted(gap_classes(summary, streamed).items())}
    return {"requests": len(reqs), "completed": len(ok), "tpot_p50": _pct(tpot, 50), "tpot_p99": _pct(tpot, 99),
            "ttft_p50": _pct(ttft, 50), "ttft_p99": _pct(ttft, 99),
            "throughput": round(tokens / dur, 1) if dur > 0 else None,
            "output_not_at_max": sum(1 for r in ok if r["output_len"] != r["expected_output_len"]),
            "coalesced_tokens_p50": _pct(coalesced, 50),
            "decode_gaps_by_mix": gaps,
            "first_token_ready_p50_estimate": _pct(ready, 50),
            "tpot_from_ready_p50_estimate": _pct(tpot_ready, 50),
            "tpot_from_ready_p99_estimate": _pct(tpot_ready, 99)}


def _ready_s(r: dict) -> float:
    """A streamed request's first token's estimated ready time (s after its send): its TTFT less
    its coalesced tokens at its own median gap."""
    return r["ttft"] - _coalesced(r) * _median(r["itl"])


def _day(text: str) -> str:
    """argparse type of --date: a YYYY-MM-DD day (argparse names the option when it is not)."""
    import datetime
    return datetime.date.fromisoformat(text).isoformat()


def _median(values: list[float]) -> float:
    import statistics
    return statistics.median(values)


def token_times(r: dict) -> list[float]:
    """Seconds (after the run's start) at which each of the request's tokens arrived."""
    t = r["sent_at"] + r["ttft"]
    out = [t]
    for gap in r.get("itl") or []:
        t += gap
        out.append(t)
    return out


def prefill_window_stats(summary: dict) -> dict:
    """The short requests' inter-token gaps (ms) while the 100k prompt prefilled (its send to its
    first token), and before it was sent."""
    reqs = [r for r in summary["requests"] if not r.get("error") and r.get("ttft") is not None]
    longest = max((r["prompt_len"] for r in summary["requests"]), default=0)
    long = [r for r in reqs if r["prompt_len"] == longest]
    if not long or len(long) == len(reqs):
        return {"error": "the 100k request failed"}
    w0 = long[0]["sent_at"]
    w1 = w0 + long[0]["ttft"]
    during, before = [], []
    for r in reqs:
        if r["prompt_len"] == longest:
            continue
        ts = token_times(r)
        for a, b in zip(ts, ts[1:]):
            if w0 <= b <= w1:
                during.append(1000 * (b - a))
            elif b < w0:
                before.append(1000 * (b - a))
    return {"prefill_s": round(w1 - w0, 2), "gaps_during": len(during), "itl_p50_during": _pct(during, 50),
            "itl_p99_during": _pct(during, 99), "itl_max_during": round(max(during), 1) if during else None,
            "itl_p50_before": _pct(before, 50), "itl_p99_before": _pct(before, 99)}


def _brief(summary: dict | None, scenario: str) -> str:
    if summary is None:
        return "no result"
    if scenario == "prefill100k":
        return json.dumps(prefill_window_stats(summary))
    return json.dumps(stats(summary, _mix_kind(summary, long=False)) if scenario == "mix" else stats(summary))


def _mix_kind(summary: dict, long: bool):
    """mix: a filter of its long requests (the run's longest prompts: all long ones have one length,
    every short one is cut below it) or of its short ones."""
    longest = max((r["prompt_len"] for r in summary["requests"]), default=0)
    return lambda r: (r["prompt_len"] == longest) == long


def engine_runs(work: Path, engine: str) -> dict:
    """One engine's per-scenario figures from its run files in work."""
    runs: dict = {}
    for scenario in SCENARIOS:
        s = _load(work / f"lc_{engine}_{scenario}.json")
        if s is None:
            continue
        if scenario in LENGTHS:
            runs[scenario.removeprefix("len")] = stats(s)
        elif scenario == "mix":
            runs["mix_short"] = stats(s, _mix_kind(s, long=False))
            runs["mix_long"] = stats(s, _mix_kind(s, long=True))
        else:
            runs["prefill100k"] = prefill_window_stats(s)
    return runs


def ratios_over_vllm(ours_result: dict, vllm_result: dict) -> dict:
    """<metric>_over_vllm_<length> of one pagedserve run against the vLLM run (None where either
    lacks the figure), the decode gaps during the 100k prefill and the start-up."""
    ratios: dict = {}
    ours, theirs = ours_result["runs"], vllm_result["runs"]
    for key in ("8k", "32k", "100k", "mix_short", "mix_long"):
        p, v = ours.get(key), theirs.get(key)
        for metric in ("tpot_p50", "tpot_p99", "ttft_p50", "ttft_p99", "throughput"):
            a, b = (p or {}).get(metric), (v or {}).get(metric)
            ratios[f"{metric}_over_vllm_{key}"] = round(a / b, 3) if a and b else None
    # Beside the targets' ratios, not in place of them: the decode steps' own pace and the first
    # tokens' estimated ready times, which a coalescing stream moves between TTFT and TPOT.
    for key in ("8k", "32k", "100k", "mix_short", "mix_long"):
        p, v = ours.get(key) or {}, theirs.get(key) or {}
        ratios[f"decode_gap_matched_over_vllm_{key}"] = (
            matched_gap_ratio(p["decode_gaps_by_mix"], v["decode_gaps_by_mix"])
            if "decode_gaps_by_mix" in p and "decode_gaps_by_mix" in v else None)
        for metric in ("first_token_ready_p50", "tpot_from_ready_p50", "tpot_from_ready_p99"):
            a, b = p.get(f"{metric}_estimate"), v.get(f"{metric}_estimate")
            ratios[f"{metric}_over_vllm_{key}"] = round(a / b, 3) if a and b else None
    p, v = ours.get("prefill100k") or {}, theirs.get("prefill100k") or {}
    for q in ("p50", "p99"):
        a, b = p.get(f"itl_{q}_during"), v.get(f"itl_{q}_during")
        ratios[f"decode_itl_{q}_during_100k_prefill_over_vllm"] = round(a / b, 3) if a and b else None
    a, b = ours_result["startup_seconds"], vllm_result["startup_seconds"]
    ratios["startup_seconds_over_vllm"] = round(a / b, 3) if a and b else None
    return ratios


def phase_collect(args, work: Path) -> None:
    from pagedserve.benchmark.results import write_result
    results: dict = {}
    for engine in ("vllm", "pagedserve"):
        info = _load(work / f"lc_{engine}_info.json") or {}
        runs = engine_runs(work, engine)
        results[engine] = {"startup_seconds": info.get("startup_seconds"), "server_args": info.get("server_args"),
                           "error": info.get("error"), "runs": runs}
    ratios = ratios_over_vllm(results["pagedserve"], results["vllm"])
    config = {"model": os.path.relpath(args.model, REPO), "max_model_len": args.max_model_len,
              "output_len": OUTPUT_LEN, "placement": "one after the other, one GPU",
              "scenarios": {k: getattr(args, k) for k in ("n8k", "rate8k", "n32k", "rate32k", "n100k", "rate100k",
                                                          "mix_short_rate", "mix_long_rate", "mix_seconds",
                                                          "prefill_decodes", "decode_output_len",
                                                          "prompt_scale")},
              "pagedserve_args": args.pagedserve_args, "vllm_args": args.vllm_args}
    for alt in args.alt_work or []:  # another pagedserve run (other flags), reported beside, no ratios
        label, _, path = alt.partition("=")
        alt_info = _load(Path(path) / "lc_pagedserve_info.json") or {}
        results[f"pagedserve_{label}"] = {"startup_seconds": alt_info.get("startup_seconds"),
                                          "server_args": alt_info.get("server_args"),
                                          "env_switches": alt_info.get("env_switches"),
                                          "commit": alt_info.get("commit"), "runs": engine_runs(Path(path), "pagedserve")}
        # Beside the headline's, not in place of them: what an alternative run's switches would give.
        results[f"pagedserve_{label}"]["ratios_over_vllm"] = ratios_over_vllm(results[f"pagedserve_{label}"],
                                                                              results["vllm"])
    ours_info = _load(work / "lc_pagedserve_info.json") or {}
    # The environment switches as the measured server saw them, not as this (collecting) process does.
    write_result(Path(args.output), "long_context_vs_vllm",
                 "python benchmarks/serving/long_context.py " + shlex.join(sys.argv[1:]), config, results,
                 {"vllm": "0.26.0"}, ratios, device=args.device, measured_commit=ours_info.get("commit"),
                 switches=ours_info.get("env_switches"), host=ours_info.get("host"), date=args.date,
                 extra={"note": args.note} if args.note else None)
    print(json.dumps(ratios, indent=1))


def _kernel_profiler(host: bool = False):
    """The device's kernels; with host, the host's torch ops too (for --trace: where a step's host time goes)."""
    import torch
    acts = [torch.profiler.ProfilerActivity.CUDA] + ([torch.profiler.ProfilerActivity.CPU] if host else [])
    return torch.profiler.profile(activities=acts)


def _top_kernels(prof, top: int = 30) -> list[dict]:
    """The profiled window's device kernels by total time: name, calls, total ms, share of all."""
    rows = [e for e in prof.key_averages() if e.device_time_total > 0 and str(e.device_type).endswith("CUDA")]
    total = sum(e.self_device_time_total for e in rows) or 1.0
    rows.sort(key=lambda e: e.self_device_time_total, reverse=True)
    return [{"kernel": e.key[:120], "calls": e.count, "ms": round(e.self_device_time_total / 1e3, 2),
             "share": round(e.self_device_time_total / total, 4)} for e in rows[:top]]


def _top_host_ops(prof, top: int = 25) -> list[dict]:
    """With --profile-host: the host's torch ops by their own (self) CPU time."""
    rows = [e for e in prof.key_averages() if str(e.device_type).endswith("CPU") and e.self_cpu_time_total > 0]
    rows.sort(key=lambda e: e.self_cpu_time_total, reverse=True)
    return [{"op": e.key[:120], "calls": e.count, "self_ms": round(e.self_cpu_time_total / 1e3, 2),
             "total_ms": round(e.cpu_time_total / 1e3, 2)} for e in rows[:top]]


def _device_idle(prof, top: int = 12) -> dict:
    """The profiled window's device timeline: when the first kernel started (from the profiler's
    start: the host's lead, e.g. a request's admission and its first step's inputs), kernels' busy
    time (their union), the span from the first kernel's start to the last one's end, and the idle
    gaps between kernels over 0.2 ms (the host keeping the GPU waiting: step boundaries, syncs), the
    longest with the kernel before them."""
    spans = sorted((e.time_range.start, e.time_range.end, e.name) for e in prof.events()
                   if str(e.device_type).endswith("CUDA") and e.time_range.end > e.time_range.start)
    if not spans:
        return {}
    busy, gaps, end, before = 0.0, [], spans[0][0], spans[0][2]
    for s, e, name in spans:
        if s > end:
            if s - end > 200:
                gaps.append((s - end, before))
        busy += max(0.0, e - max(s, end))
        if e > end:
            end, before = e, name
    gaps.sort(reverse=True)
    return {"first_kernel_at_ms": round(spans[0][0] / 1e3, 2),
            "span_ms": round((end - spans[0][0]) / 1e3, 2), "busy_ms": round(busy / 1e3, 2),
            "gaps_over_0.2ms": len(gaps), "gaps_over_0.2ms_ms": round(sum(g for g, _ in gaps) / 1e3, 2),
            "longest_gaps": [{"ms": round(g / 1e3, 2), "after": n[:80]} for g, n in gaps[:top]]}


def phase_prefill(args) -> None:
    """One engine in this process (its switches from the environment): start-up seconds, then each
    of --prefill-lens as one fresh prompt with 1 output token, one at a time: that request's
    seconds are its prefill's (an A/B of long-prefill paths, e.g. PAGEDSERVE_LONG_PREFILL=cudnn).
    --engine vllm runs vLLM's offline LLM the same way (same model, budget and block size)."""
    from pagedserve.attention import gathered_prefill_plan
    from pagedserve.benchmark.results import ENV_SWITCHES
    if args.engine == "vllm":
        if args.beside_decodes or args.near_end or args.step_times or args.gather_modes:
            raise SystemExit("--beside-decodes, --near-end, --step-times and --gather-modes drive pagedserve's "
                             "engine; not with --engine vllm")
        # Its server's environment (vs_vllm.ENV), and its engine core in this process, so that the
        # profiler sees its kernels too.
        os.environ.update({**vv.ENV, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"})
        import vllm
        from vllm import LLM, SamplingParams
    else:
        from pagedserve import LLM, SamplingParams
    ours = {} if args.engine == "vllm" or args.chunk_align is None else {"long_prefill_chunk_align": args.chunk_align}
    if args.gathered_min_prefix is not None:  # an A/B of the constant; the engine runs in this process
        gathered_prefill_plan.MIN_PREFIX = args.gathered_min_prefix
    t0 = time.perf_counter()
    llm = LLM(str(args.model), load_format="dummy", max_model_len=args.max_model_len, block_size=args.block_size,
              skip_tokenizer_init=True, max_num_batched_tokens=args.max_num_batched_tokens, **ours)
    rec = {"engine": args.engine if args.engine == "pagedserve" else f"vllm {vllm.__version__}",
           "command": getattr(args, "command", None), "date": time.strftime("%Y-%m-%d", time.gmtime()),
           "startup_seconds": time.perf_counter() - t0, "block_size": args.block_size,
           "max_num_batched_tokens": args.max_num_batched_tokens,
           "gathered_min_prefix": gathered_prefill_plan.MIN_PREFIX,
           # The engine's own value (--chunk-align or its default); vLLM has none.
           "long_prefill_chunk_align": (None if args.engine == "vllm"
                                        else llm.llm_engine.scheduler_config.long_prefill_chunk_align),
           "prefill_seconds": {},
           "env_switches": {k: os.environ.get(k) for k in ENV_SWITCHES if os.environ.get(k)}, **_measured_code()}
    rng = random.Random(7)
    vocab = min(VOCAB_DRAW, json.loads((Path(args.model) / "config.json").read_text())["vocab_size"])
    if args.gather_modes:
        rec["gather_modes"] = args.gather_modes
    modes = args.gather_modes or [None]
    runs = [(n, mode) for i, n in enumerate(args.prefill_lens) for mode in (modes if i % 2 == 0 else modes[::-1])]
    for j, (n, mode) in enumerate(runs):
        if mode is not None:
            _set_gather(mode)
        prompt = [rng.randrange(vocab) for _ in range(n)]
        profile = args.profile and j == (0 if args.profile_prompt == "first" else len(runs) - 1)
        before = _path_counts() if args.engine == "pagedserve" else None
        prof = _kernel_profiler(args.profile_host) if profile else contextlib.nullcontext()
        with prof:  # the clock inside: the profiler's start and its trace's collection are not the prefill's
            t = time.perf_counter()
            if args.step_times:  # the engine's own loop, each step timed (a first run's slow step shows)
                admit_ms, steps = _timed_steps(llm, f"p{j}", prompt)
                rec.setdefault("add_request_ms", {}).setdefault(str(n), []).append(admit_ms)
                rec.setdefault("step_ms", {}).setdefault(str(n), []).append(steps)
            else:
                llm.generate([{"prompt_token_ids": prompt} if args.engine == "vllm" else prompt],
                             SamplingParams(max_tokens=1, ignore_eos=True), use_tqdm=False)
            seconds = round(time.perf_counter() - t, 3)
        if profile:  # the prompt's kernels, by total device time (the profiler slows the host)
            timeline = _device_idle(prof)
            if timeline:  # the prompt's time after the last kernel (the output's host work), ~ to the
                # profiler's start-up (first_kernel_at_ms counts from the profiler's start, just before t)
                timeline["after_last_kernel_ms"] = round(1e3 * seconds - timeline["first_kernel_at_ms"]
                                                         - timeline["span_ms"], 2)
            rec["profile"] = {"prompt_len": n, "prompt": args.profile_prompt, "seconds_profiled": seconds,
                              "kernels": _top_kernels(prof), "device_timeline": timeline}
            if args.profile_host:
                rec["profile"]["host_ops"] = _top_host_ops(prof)
            if args.trace:
                prof.export_chrome_trace(args.trace)
        key = str(n) if mode is None else f"{n}-{mode}"
        rec["prefill_seconds"].setdefault(key, []).append(seconds)  # a length given twice: both runs
        after = _path_counts() if args.engine == "pagedserve" else None
        if after is not None:  # how its long chunks' context was read: [in place, gathered] layer-chunks
            rec.setdefault("long_chunks_read", {}).setdefault(key, []).append([a - b for a, b in zip(after, before)])
        print(f"prefill {key}: {seconds} s", flush=True)
    if args.beside_decodes:
        rec["beside_decodes"] = prefill_beside_decodes(llm, args, rng, vocab)
    Path(args.out).write_text(json.dumps(rec, indent=1))
    if args.near_end:
        rec["near_end"] = prefill_near_end(llm, args, rng, vocab, Path(args.out), rec)


def _long_path():
    """The running engine's long-prefill path (gathered_prefill.GatheredPrefill) on this GPU, or None."""
    import torch
    from pagedserve.attention import gathered_prefill
    return gathered_prefill.active(torch.device("cuda", torch.cuda.current_device())) if torch.cuda.is_available() else None


def _path_counts() -> tuple[int, int] | None:
    """The long-prefill path's (layer-chunks read in place, gathered) so far, None without it."""
    g = _long_path()
    return None if g is None else (g.chunks_in_place, g.chunks_gathered)


def _set_gather(mode: str) -> None:
    """--gather-modes: PAGEDSERVE_LONG_PREFILL_GATHER's choice set on the running engine's path
    ('runs': pages in one run of the pool read in place; 'always': gathered). After the A/B the
    last mode stays set (the engine is done)."""
    g = _long_path()
    if g is None:
        raise SystemExit("--gather-modes: the engine has no long-prefill path on this device")
    g.pages_in_place = mode == "runs"


def _timed_steps(llm, request_id: str, prompt: list[int]) -> tuple[float, list[float]]:
    """pagedserve's engine steps for one fresh prompt (1 output token): the milliseconds of its
    add_request, and of each step."""
    from pagedserve import SamplingParams
    eng, steps = llm.llm_engine, []
    t = time.perf_counter()
    eng.add_request(request_id, prompt, SamplingParams(max_tokens=1, ignore_eos=True))
    last = time.perf_counter()
    admit_ms = round(1e3 * (last - t), 2)
    while eng.has_unfinished_requests():
        eng.step()
        now = time.perf_counter()
        steps.append(round(1e3 * (now - last), 2))
        last = now
    return admit_ms, steps


def prefill_near_end(llm, args, rng, vocab, out: Path, rec: dict) -> list[dict]:
    """--near-end T: one request (128-token prompt, 64 output tokens) decodes until it has T tokens
    left, then a fresh prompt of the last --prefill-lens length arrives; per --drains value N (the
    engine's long_prefill_drain, set on the running scheduler's config): the seconds (and steps) from
    that arrival to the decoding request's end and to the prompt's first token.
    The JSON is rewritten after each run (a cut-short device call keeps what finished)."""
    from pagedserve import SamplingParams
    eng = llm.llm_engine
    n, rows = args.prefill_lens[-1], []
    for drain in args.drains:
        eng.scheduler_config.long_prefill_drain = drain
        dec_id, long_id = f"dec{drain}", f"long{drain}"
        eng.add_request(dec_id, [rng.randrange(vocab) for _ in range(128)],
                        SamplingParams(max_tokens=64, ignore_eos=True))
        made = 0
        while made < 64 - args.near_end:
            for o in eng.step():
                if o.request_id == dec_id:
                    made = len(o.outputs[0].token_ids)
        t0 = time.perf_counter()
        eng.add_request(long_id, [rng.randrange(vocab) for _ in range(n)], SamplingParams(max_tokens=1, ignore_eos=True))
        ends, steps = {}, 0
        while eng.has_unfinished_requests():
            outs = eng.step()
            steps += 1
            now = time.perf_counter()
            for o in outs:
                if o.finished and o.request_id not in ends:
                    ends[o.request_id] = (now - t0, steps)
        row = {"drain": drain, "tokens_left": args.near_end, "prompt_len": n, "steps": steps,
               "decode_end_s": round(ends[dec_id][0], 3), "prompt_first_token_s": round(ends[long_id][0], 3),
               "decode_end_step": ends[dec_id][1], "prompt_first_token_step": ends[long_id][1]}
        rows.append(row)
        print(json.dumps(row), flush=True)
        out.write_text(json.dumps({**rec, "near_end": rows}, indent=1))
    return rows


def prefill_beside_decodes(llm, args, rng, vocab) -> list[dict]:
    """For each --beside-lens length (default the last --prefill-lens), --beside-aligns alignment
    (default the engine's), --beside-decodes count N and --cost-scales factor f: N requests
    (128-token prompts) decoding, then one fresh prompt of that length; its seconds to its first
    token and the steps meanwhile (each a token for every decode: their gaps). f scales the engine's
    K: the model's compute balance (model_cost.attention_cost_context) times f; it and the alignment
    are set on the running scheduler's config between runs (core/chunk_cost.py; f = 0: chunks by
    tokens alone; the engine's own is long_prefill_cost_scale's), so one start-up serves the A/B."""
    from pagedserve.model_cost import ModelCost
    cfg = llm.llm_engine.scheduler_config
    k_engine, align_engine = cfg.attention_cost_context, cfg.long_prefill_chunk_align
    k0 = ModelCost.from_hf_config(llm.llm_engine.hf_config).attention_cost_context()
    rows = []
    configs = [(n, align, decodes, f, mode) for n in args.beside_lens or [args.prefill_lens[-1]]
               for align in args.beside_aligns or [align_engine] for decodes in args.beside_decodes
               for f in args.cost_scales for mode in args.gather_modes or [None]]
    # Repeats go round the whole list, so that an A/B's arms alternate in time (a drifting clock or
    # a neighbour's load falls on both).
    for rep in range(args.beside_repeats):
        for n, align, decodes, f, mode in configs:
            if mode is not None:
                _set_gather(mode)
            cfg.attention_cost_context, cfg.long_prefill_chunk_align = round(k0 * f), align
            tag = f"{n}-{align}-{decodes}-{f}" + (f"-{mode}" if mode else "") + f"-r{rep}"
            before = _path_counts()
            row = {"decodes": decodes, "cost_scale": f, "attention_cost_context": round(k0 * f),
                   "chunk_align": align, "prompt_len": n, "repeat": rep, **({"gather": mode} if mode else {}),
                   **_beside_run(llm.llm_engine, rng, vocab, n, decodes, tag, args.decode_output_len,
                                 args.beside_decode_prompt_len)}
            if before is not None:
                row["long_chunks_read"] = [a - b for a, b in zip(_path_counts(), before)]
            rows.append(row)
            print(json.dumps(row), flush=True)
    cfg.attention_cost_context, cfg.long_prefill_chunk_align = k_engine, align_engine
    return rows


def _beside_run(eng, rng, vocab, n: int, decodes: int, tag: str, decode_output_len: int,
                decode_prompt_len: int) -> dict:
    """One prompt of n tokens beside `decodes` decoding requests of decode_prompt_len-token prompts
    (prefill_beside_decodes)."""
    from pagedserve import SamplingParams
    short = [f"d{tag}-{i}" for i in range(decodes)]
    for rid in short:
        eng.add_request(rid, [rng.randrange(vocab) for _ in range(decode_prompt_len)],
                        SamplingParams(max_tokens=decode_output_len, ignore_eos=True))
    started: set[str] = set()
    while len(started) < decodes:  # their prefill (long prompts take many steps) up to a first token each
        started |= {o.request_id for o in eng.step() if o.outputs[0].token_ids}
    for _ in range(3):  # then decodes only
        eng.step()
    long_id = f"long{tag}"
    t0 = last = time.perf_counter()
    eng.add_request(long_id, [rng.randrange(vocab) for _ in range(n)], SamplingParams(max_tokens=1, ignore_eos=True))
    gaps, chunks, computed, done = [], [], 0, False
    while not done:
        outs = eng.step()
        now = time.perf_counter()
        gaps.append(now - last)
        last = now
        done = any(o.request_id == long_id and o.outputs[0].token_ids for o in outs)
        # The prompt's chunk this step: its computed tokens' growth (0 while it waited).
        seq = next((g.seqs[0] for g in eng.scheduler.running if g.request_id == long_id), None)
        now_computed = n if done else (seq.num_computed_tokens if seq is not None else computed)
        chunks.append(now_computed - computed)
        computed = now_computed
    eng.abort_request(short)
    while eng.has_unfinished_requests():
        eng.step()
    return {"prefill_s": round(last - t0, 3), "steps": len(gaps), "chunks": chunks,
            "gap_p50_ms": _pct([1e3 * g for g in gaps], 50), "gap_p99_ms": _pct([1e3 * g for g in gaps], 99),
            "gap_max_ms": round(1e3 * max(gaps), 2)}


def phase_replay(args) -> list[dict]:
    """replay (no GPU, no model): pagedserve's scheduler alone at serving's settings on the H200
    (--max-num-batched-tokens, --block-size, the long-prefill path's rules: K = the model's compute
    balance times each --cost-scales factor, 0: off, the engine's default; --chunk-align, default the
    engine's there, 1,024), per --beside-decodes count and --prefill-lens length: one fresh prompt
    beside that many decoding requests, and the chunks it is cut into, step by step (what `prefill
    --beside-decodes` measures the time of)."""
    from transformers import AutoConfig

    from pagedserve.core.chunk_cost import CHUNK_ALIGN, COST_MIN_TOKENS
    from pagedserve.core.config import CacheConfig, SchedulerConfig
    from pagedserve.core.scheduler import Scheduler
    from pagedserve.model_cost import ModelCost
    from pagedserve.sampling_params import SamplingParams
    from pagedserve.sequence import Sequence, SequenceGroup
    k0 = ModelCost.from_hf_config(AutoConfig.from_pretrained(args.model)).attention_cost_context()
    align = CHUNK_ALIGN if args.chunk_align is None else args.chunk_align
    rows = []
    for n in args.prefill_lens:
        for decodes in args.beside_decodes or [1]:
            for f in args.cost_scales:
                blocks = 2 * -(-(n + 1024 * decodes) // args.block_size)  # room to spare: nothing waits for blocks
                sched = Scheduler(SchedulerConfig(
                    max_num_batched_tokens=args.max_num_batched_tokens, max_model_len=args.max_model_len,
                    attention_cost_context=round(k0 * f), attention_cost_min_tokens=COST_MIN_TOKENS,
                    long_prefill_chunk_align=align),
                    CacheConfig(block_size=args.block_size, num_gpu_blocks=blocks, enable_prefix_caching=False))

                def group(rid, length, max_tokens):
                    return SequenceGroup(rid, [Sequence(list(range(length)))],
                                         SamplingParams(max_tokens=max_tokens, ignore_eos=True))

                def step():
                    out = sched.schedule()
                    sched.update_after_step(out)
                    for ss in out.scheduled:
                        if ss.do_sample:
                            ss.seq.append_token(1)
                    return out
                for i in range(decodes):
                    sched.add_seq_group(group(f"d{i}", 128, args.max_model_len - 128))
                for _ in range(4):  # their prefill, then decodes only
                    step()
                long_ = group("long", n, 1)
                sched.add_seq_group(long_)
                chunks = []
                while sum(chunks) < n:
                    chunks += [ss.num_new_tokens for ss in step().scheduled if ss.group is long_]
                row = {"prompt_len": n, "decodes": decodes, "cost_scale": f, "attention_cost_context": round(k0 * f),
                       "chunk_align": align, "max_num_batched_tokens": args.max_num_batched_tokens,
                       "steps": len(chunks), "chunks": chunks}
                rows.append(row)
                print(json.dumps(row), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps({"phase": "replay", "model": args.model, "rows": rows}, indent=1) + "\n")
    return rows


def phase_gaps(args, work: Path) -> dict:
    """gaps (no GPU): every inter-token gap of a scenario's records (lc_<engine>_<scenario>.json in
    --work), classed as gap_classes does: each engine's median and count per class. A decode step's
    time by its mix, where TPOTs mix steps of every kind (docs/long-context-history.md, 41st session)."""
    classes = {}
    for engine in ("pagedserve", "vllm"):
        path = work / f"lc_{engine}_{args.scenario}.json"
        if not path.exists():
            continue
        summary = json.loads(path.read_text())
        kept = [r for r in summary["requests"] if not r.get("error") and r.get("ttft") is not None]
        classes[engine] = {k: {"n": len(v), "median_ms": round(_median(v), 2)}
                           for k, v in sorted(gap_classes(summary, kept).items())}
    print(json.dumps(classes, indent=1))
    return classes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("phase", choices=["online", "collect", "client", "prefill", "replay", "gaps"])
    ap.add_argument("--site", default=os.environ.get("SITE", os.path.join(tempfile.gettempdir(), "site")))
    ap.add_argument("--gpu", default="0")
    ap.add_argument("--work", default=os.environ.get("OUT") or tempfile.mkdtemp())
    ap.add_argument("--model", default=str(REPO / "benchmarks/models/llama-3.1-8b"))
    ap.add_argument("--engines", default="vllm,pagedserve")
    ap.add_argument("--scenarios", nargs="+", default=list(SCENARIOS), choices=SCENARIOS)
    ap.add_argument("--max-model-len", type=int, default=131072)
    ap.add_argument("--n8k", type=int, default=24)
    ap.add_argument("--rate8k", type=float, default=1.0)
    ap.add_argument("--n32k", type=int, default=12)
    ap.add_argument("--rate32k", type=float, default=0.25)
    ap.add_argument("--n100k", type=int, default=5)
    ap.add_argument("--rate100k", type=float, default=0.08)
    ap.add_argument("--mix-short-rate", type=float, default=2.0)
    ap.add_argument("--mix-long-rate", type=float, default=0.1)
    ap.add_argument("--mix-seconds", type=float, default=60.0)
    ap.add_argument("--prefill-decodes", type=int, default=32)
    ap.add_argument("--decode-output-len", type=int, default=1024,
                    help="prefill100k: output tokens of the short requests decoding around the 100k prefill")
    ap.add_argument("--prompt-scale", type=float, default=1.0,
                    help="every long prompt's length times this (a smoke run on a small model; 1 for the benchmark)")
    ap.add_argument("--pagedserve-args", default="")
    ap.add_argument("--vllm-args", default="")
    ap.add_argument("--startup-limit", type=float, default=300)
    ap.add_argument("--rate-limit", type=float, default=150, help="seconds one scenario's client may run")
    ap.add_argument("--output", default=str(REPO / "benchmarks/results/h200/long_context.json"))
    ap.add_argument("--device", default=None)
    ap.add_argument("--note", default=None)
    ap.add_argument("--date", default=None, type=_day, help="collect: the day the runs were made (YYYY-MM-DD; default today)")
    ap.add_argument("--alt-work", action="append", metavar="LABEL=DIR",
                    help="collect: another pagedserve run's work dir (e.g. piecewise=DIR), kept as results['pagedserve_LABEL']")
    ap.add_argument("--prefill-lens", type=int, nargs="+", default=[32768, 100_000, 100_000],
                    help="prefill: prompt lengths, one request each, in order")
    ap.add_argument("--block-size", type=int, default=16, help="prefill: the engine's KV block size")
    ap.add_argument("--engine", choices=["pagedserve", "vllm"], default="pagedserve",
                    help="prefill: whose engine runs in this process (vllm: import it from PYTHONPATH, "
                         "its engine core in-process so that --profile sees its kernels)")
    ap.add_argument("--max-num-batched-tokens", type=int, default=8192,
                    help="prefill: the step budget (default 8192, the server's on the H200, so the chunks are "
                         "serving's; the offline engine's own default there is 16384, as until the 36th session)")
    ap.add_argument("--gathered-min-prefix", type=int, default=None,
                    help="prefill: gathered_prefill_plan.MIN_PREFIX for this run (an A/B; default the module's)")
    ap.add_argument("--chunk-align", type=int, default=None,
                    help="prefill: pagedserve's long_prefill_chunk_align (default: the engine's, 1,024 on Hopper)")
    ap.add_argument("--step-times", action="store_true",
                    help="prefill: run each prompt through pagedserve's engine loop and record every step's ms")
    ap.add_argument("--profile", action="store_true",
                    help="prefill: the last prompt (--profile-prompt) under torch.profiler; its top kernels and the device's "
                         "idle gaps go in the JSON")
    ap.add_argument("--profile-prompt", choices=["first", "last"], default="last",
                    help="prefill --profile: which prompt (the first after start-up pays once-per-engine costs)")
    ap.add_argument("--profile-host", action="store_true",
                    help="prefill --profile: the host's torch ops too (see them in --trace's chrome trace)")
    ap.add_argument("--beside-decodes", type=int, nargs="*", default=[],
                    help="prefill: then the last --prefill-lens length again beside this many decoding requests "
                         "(each count in turn), per --cost-scales factor")
    ap.add_argument("--beside-lens", type=int, nargs="*", default=[],
                    help="prefill --beside-decodes: these prompt lengths (default: the last --prefill-lens)")
    ap.add_argument("--beside-aligns", type=int, nargs="*", default=[],
                    help="prefill --beside-decodes: each long_prefill_chunk_align in turn (default: the engine's)")
    ap.add_argument("--beside-decode-prompt-len", type=int, default=128,
                    help="prefill --beside-decodes: the decoding requests' prompt length (their context: each step "
                         "beside them reads it; online, the 100k scenario's decodes are 100k contexts themselves)")
    ap.add_argument("--beside-repeats", type=int, default=1,
                    help="prefill --beside-decodes: run the whole list of configurations this many times over")
    ap.add_argument("--cost-scales", type=float, nargs="+", default=[0.0],
                    help="prefill --beside-decodes, replay: K = the model's compute balance times each (0: chunks by "
                         "tokens alone, the engine's default; its long_prefill_budget_by_cost uses 2)")
    ap.add_argument("--gather-modes", nargs="*", default=[], choices=["runs", "always"],
                    help="prefill: each prompt (and --beside-decodes run) once per mode of "
                         "PAGEDSERVE_LONG_PREFILL_GATHER, set on the running engine in turn, the order "
                         "alternating by prompt (one start-up serves the A/B); keys '<len>-<mode>'")
    ap.add_argument("--trace", help="prefill with --profile: also write the profiled prompt's chrome trace here")
    ap.add_argument("--near-end", type=int, default=0, metavar="T",
                    help="prefill: then the last --prefill-lens length arriving while a request has T of its 64 "
                         "output tokens left, once per --drains value (long_prefill_drain)")
    ap.add_argument("--drains", type=int, nargs="+", default=[0, 2048],
                    help="prefill --near-end: the engine's long_prefill_drain for each run (0: off)")
    # client (internal): one scenario against a running server
    ap.add_argument("--scenario", choices=SCENARIOS)
    ap.add_argument("--port", type=int)
    ap.add_argument("--out")
    args = ap.parse_args()
    args.command = shlex.join(["python3", "benchmarks/serving/long_context.py", *sys.argv[1:]])  # into prefill's file
    if args.phase == "client":
        run_client(args)
        return
    if args.phase == "prefill":
        phase_prefill(args)
        return
    if args.phase == "replay":
        phase_replay(args)
        return
    work = Path(args.work)
    if args.phase == "gaps":
        phase_gaps(args, work)
        return
    work.mkdir(parents=True, exist_ok=True)
    if args.phase == "online":
        phase_online(args, work)
    else:
        phase_collect(args, work)


if __name__ == "__main__":
    main()
