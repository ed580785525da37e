#!/usr/bin/env python3
"""Structured outputs beside vLLM (#32): the sharegpt-like load with and without a JSON schema on
every request, both OpenAI servers on the same GPU, one after the other.

    python3 benchmarks/serving/structured_vs_vllm.py online --engines vllm --site $SITE         # one device call
    python3 benchmarks/serving/structured_vs_vllm.py online --engines pagedserve --site $SITE   # the next
    python3 benchmarks/serving/structured_vs_vllm.py collect --work DIR                         # here or there

Each engine serves Llama-3.1-8B with dummy weights and a 128k byte-level BPE tokenizer
(benchmarks/serving/make_bpe_model_dir.py: the word-level benchmark tokenizer has no JSON characters), and at each
rate runs the load unconstrained, then with `structured_outputs.json` from the fixed set of 50
schemas (`pagedserve bench serve --json-schemas 50`), whose arrays cannot close before
max_tokens: both runs produce the same tokens per request, so their TPOTs differ by the grammar
alone. Every run's prompts differ in their first token (`bench serve --prompt-salt`), so each
starts with a cold prefix cache; before 2026-12-02 the runs repeated one prompt set, so the first
(r10 plain) ran cold and the rest found their prompts cached, and a run of one rate alone put the
unconstrained run at that disadvantage. collect writes benchmarks/results/h200/structured.json with tpot_p50_over_vllm_json_rN
(ours constrained over vLLM's constrained), tpot_overhead_json_rN (ours constrained over ours
unconstrained) and the same overhead for vLLM, plus the per-request output-length check.
Grammar compile times and the host's per-step mask cost are measured apart, on the same machine
(benchmarks/kernels/structured_mask_cost.py --output WORK/structured_mask_cost.json), and merged in by collect.
"""
from __future__ import annotations

import argparse
import json
import os
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


def online_one(engine: str, args, model_dir: Path, work: Path) -> None:
    port = vv.PORTS[engine]
    extra = args.vllm_args if engine == "vllm" else args.pagedserve_args
    t0 = time.monotonic()
    with open(work / f"{engine}_server.log", "w") as server_log:
        proc = subprocess.Popen(vv.serve_cmd(engine, model_dir, port, args.max_model_len, extra),
                                env=vv.env_for(engine, args.site, args.gpu), stdout=server_log,
                                stderr=subprocess.STDOUT)
    info = {"engine": engine, "server_args": extra,
            "env_switches": {k: os.environ.get(k) for k in vv.ENV_SWITCHES}}
    try:
        if not vv.wait_up(port, proc, args.startup_limit):
            info["error"] = f"server did not start (rc={proc.poll()})"
            vv.log(work, f"{engine}: {info['error']}")
            return
        info["startup_seconds"] = round(time.monotonic() - t0, 1)
        vv.log(work, f"{engine} up after {info['startup_seconds']} s")
        runs = [(rate, variant, flags) for rate in args.rates
                for variant, flags in (("plain", []), ("json", ["--json-schemas", str(args.json_schemas)]))]
        for salt, (rate, variant, flags) in enumerate(runs, start=1):
            flags = [*flags, "--prompt-salt", str(salt)]  # each run's prompts cold in the prefix cache
            out = work / f"structured_{engine}_r{rate:g}_{variant}.json"
            cmd = [sys.executable, "-m", "pagedserve.entrypoints.cli", "bench", "serve",
                   "--base-url", f"http://127.0.0.1:{port}/v1", "--workload", args.workload,
                   "--num-requests", str(args.num_requests), "--request-rate", str(rate),
                   "--output", str(out), "--tokenizer", str(model_dir), "--disable-tqdm", *flags]
            r = subprocess.run(cmd, env={**os.environ, **vv.ENV, "PYTHONPATH": f"{REPO}:{args.site}"},
                               capture_output=True, text=True, timeout=args.rate_limit)
            tail = [ln for ln in r.stdout.splitlines() if any(k in ln for k in ("completed", "TPOT", "TTFT"))]
            vv.log(work, f"{engine} r{rate:g} {variant} rc={r.returncode}: " + " | ".join(tail)[:300])
            if r.returncode != 0:
                vv.log(work, r.stderr[-1200:])
    finally:
        vv.stop_process(proc)
        (work / f"structured_{engine}_info.json").write_text(json.dumps(info, indent=1))


def phase_online(args, work: Path) -> None:
    model_dir = work / "model_bpe"
    if not (model_dir / "tokenizer.json").exists():
        subprocess.run([sys.executable, str(HERE / "make_bpe_model_dir.py"), args.model, str(model_dir)],
                       check=True, env={**os.environ, "PYTHONPATH": args.site})
    for engine in args.engines.split(","):
        online_one(engine, args, model_dir, work)


def _summary(d: dict | None) -> dict | None:
    if d is None:
        return None
    d = d.get("results", d)
    reqs = d.get("requests", [])
    short = sum(1 for r in reqs if not r.get("error") and r["output_len"] != r["expected_output_len"])
    keep = {k: d[k] for k in ("completed", "failed", "request_throughput", "output_throughput", "ttft_ms",
                              "tpot_ms", "e2e_latency_ms") if k in d}
    keep["requests_not_at_max_tokens"] = short
    errors = sorted({r["error"] for r in reqs if r.get("error")})
    if errors:
        keep["errors"] = errors[:3]
    return keep


def _tpot_p50(run: dict | None) -> float | None:
    """A run's TPOT p50, or None when it has none (every request failed)."""
    if not run or not run.get("completed"):
        return None
    return run["tpot_ms"]["p50"]


def phase_collect(args, work: Path) -> None:
    from pagedserve.benchmark.results import write_result
    results: dict = {}
    ratios: dict = {}
    earlier = json.loads(Path(args.ours_from).read_text()) if args.ours_from else None
    for engine in ("vllm", "pagedserve"):
        if engine == "pagedserve" and earlier is not None:
            # Our runs as an earlier collect summarised them (its commit is kept as measured_commit).
            results[engine] = {**earlier["results"]["pagedserve"], "from": earlier["command"]}
            continue
        info = vv._load(work / f"structured_{engine}_info.json") or {}
        runs = {f"r{r:g}_{v}": _summary(vv._load(work / f"structured_{engine}_r{r:g}_{v}.json"))
                for r in args.rates for v in ("plain", "json")}
        results[engine] = {"startup_seconds": info.get("startup_seconds"), "server_args": info.get("server_args"),
                           "error": info.get("error"), "runs": runs}
    for rate in args.rates:
        k = f"r{rate:g}"
        p, v = results["pagedserve"]["runs"], results["vllm"]["runs"]
        ours, theirs = _tpot_p50(p.get(f"{k}_json")), _tpot_p50(v.get(f"{k}_json"))
        # A ratio only where both runs completed requests; otherwise null, and the runs say why.
        ratios[f"tpot_p50_over_vllm_json_{k}"] = round(ours / theirs, 3) if ours and theirs else None
        for eng, runs in (("", p), ("vllm_", v)):
            con, free = _tpot_p50(runs.get(f"{k}_json")), _tpot_p50(runs.get(f"{k}_plain"))
            ratios[f"{eng}tpot_overhead_json_{k}"] = round(con / free, 3) if con and free else None
        if ours and _tpot_p50(v.get(f"{k}_plain")):
            # Not the target's ratio (that one needs vLLM constrained too): ours constrained against
            # vLLM unconstrained, an upper bound on it whenever vLLM's grammar costs anything.
            ratios[f"tpot_p50_json_over_vllm_plain_{k}"] = round(ours / _tpot_p50(v[f"{k}_plain"]), 3)
    mask_cost = vv._load(work / "structured_mask_cost.json")
    if mask_cost is None and earlier is not None:
        mask_cost = earlier["results"].get("mask_cost")
    if mask_cost is not None:
        results["mask_cost"] = mask_cost
    bpe = vv._load(work / "model_bpe" / "bpe_info.json")
    config = {"model": os.path.relpath(args.model, REPO), "tokenizer": bpe, "workload": args.workload,
              "num_requests": args.num_requests, "rates": args.rates, "json_schemas": args.json_schemas,
              "max_model_len": args.max_model_len, "placement": "one after the other, one GPU",
              "pagedserve_args": args.pagedserve_args, "vllm_args": args.vllm_args}
    measured = {(vv._load(f) or {}).get("commit") for f in work.glob("structured_pagedserve_r*.json")} - {None}
    hosts = [(vv._load(f) or {}).get("host") for f in sorted(work.glob("structured_pagedserve_r*.json"))]
    # The environment switches as the measured server saw them, not as this (collecting) process does.
    ran_with = (vv._load(work / "structured_pagedserve_info.json") or {}).get("env_switches")
    # The day our runs were made (as their files say), not the collecting one's.
    days = sorted({(vv._load(f) or {}).get("date") for f in work.glob("structured_pagedserve_r*.json")} - {None})
    if earlier is not None:
        measured, hosts, ran_with = {earlier["commit"]}, [earlier.get("host")], earlier.get("switches")
        days = [earlier["date"]] if earlier.get("date") else []
        config["tokenizer"] = config["tokenizer"] or earlier["config"].get("tokenizer")
    write_result(Path(args.output), "structured_vs_vllm",
                 "python benchmarks/serving/structured_vs_vllm.py " + shlex.join(sys.argv[1:]), config, results,
                 {"vllm": "0.26.0"}, ratios, device=args.device,
                 measured_commit=measured.pop() if len(measured) == 1 else None, switches=ran_with,
                 host=next((h for h in hosts if h), None), date=days[0] if days else None,
                 extra={"note": args.note} if args.note else None)
    print(json.dumps(ratios, indent=1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("phase", choices=["online", "collect"])
    ap.add_argument("--site", default=os.environ.get("SITE", os.path.join(tempfile.gettempdir(), "site")))
    ap.add_argument("--gpu", default="0")
    ap.add_argument("--work", default=os.environ.get("OUT") or tempfile.mkdtemp())
    ap.add_argument("--model", default=str(REPO / "benchmarks/models/llama-3.1-8b"))
    ap.add_argument("--workload", default="sharegpt-like")
    ap.add_argument("--engines", default="vllm,pagedserve")
    ap.add_argument("--rates", type=float, nargs="+", default=[10, 40])
    ap.add_argument("--num-requests", type=int, default=300)
    ap.add_argument("--json-schemas", type=int, default=50)
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--pagedserve-args", default="")
    ap.add_argument("--vllm-args", default="")
    ap.add_argument("--startup-limit", type=float, default=300)
    ap.add_argument("--rate-limit", type=float, default=150)
    ap.add_argument("--output", default=str(REPO / "benchmarks/results/h200/structured.json"))
    ap.add_argument("--device", default=None)
    ap.add_argument("--ours-from", default=None,
                    help="collect: take our runs from an earlier structured.json (its summaries and commit) "
                         "instead of --work, e.g. when only vLLM's side was re-run")
    ap.add_argument("--note", default=None, help="collect: a note kept in the result (what failed and why)")
    args = ap.parse_args()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    if args.phase == "online":
        phase_online(args, work)
    else:
        phase_collect(args, work)


if __name__ == "__main__":
    main()
