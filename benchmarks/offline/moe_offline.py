"""Offline throughput of the MoE models (dummy weights of their real configs, bf16), ours:
`pagedserve bench throughput` for each model x workload, each in its own process, collected
into one result (default benchmarks/results/h200/moe.json) with the roofline fraction that
counts the experts each step touches (pagedserve/benchmark/roofline.py).

    python benchmarks/offline/moe_offline.py [--models qwen3-30b-a3b mixtral-8x7b] [--workloads nanovllm fixed256] \
        [--vllm-dir DIR] [--engine-args "..."] [--merge] --output benchmarks/results/h200/moe.json

One model x workload fits a 10-minute device call; --merge adds each to the same file (the
commit of each merged run is kept in config.merged_runs).

--vllm-dir: a folder of vLLM's results of the same runs, vllm_<model>_<workload>.json as written by
benchmarks/peers/bench_vllm.py --workload W --config benchmarks/models/<model>/config.json --out ...;
each found gives the ratio <model>_<workload>_over_vllm (output tokens/s, ours over theirs).
Needs CUDA.
"""
from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from pagedserve.benchmark.results import git_commit, write_result  # noqa: E402

MODELS = ("qwen3-30b-a3b", "mixtral-8x7b")


def vllm_rate(path: Path) -> float | None:
    """Output tokens/s from a bench_vllm.py JSON (its median run: results.output_tok_s)."""
    if not path.is_file():
        return None
    doc = json.loads(path.read_text())
    res = doc.get("results", doc)
    for key in ("output_tok_s", "output_tokens_per_s"):
        if isinstance(res.get(key), (int, float)):
            return float(res[key])
    return None


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", nargs="+", default=list(MODELS))
    ap.add_argument("--workloads", nargs="+", default=["nanovllm", "fixed256"])
    ap.add_argument("--engine-args", default="", help="extra flags for `pagedserve bench throughput`")
    ap.add_argument("--vllm-dir", default=None)
    ap.add_argument("--tag", default="", help="suffix of the result names (e.g. tp2, tp2_ep)")
    ap.add_argument("--output", default=str(ROOT / "benchmarks/results/h200/moe.json"))
    ap.add_argument("--merge", action="store_true",
                    help="keep the other runs already in --output (one model x workload per device call)")
    args = ap.parse_args()
    git_commit()  # refuse before measuring
    tmp = Path(tempfile.mkdtemp())
    results, ratios, switches, errors = {}, {}, {}, {}
    for model in args.models:
        for workload in args.workloads:
            run = f"{model}_{workload}"
            name = f"{run}_{args.tag}" if args.tag else run
            out = tmp / f"{name}.json"
            cmd = [sys.executable, "-m", "pagedserve.entrypoints.cli", "bench", "throughput", "--workload", workload,
                   "--model", str(ROOT / "benchmarks/models" / model), "--output", str(out),
                   *shlex.split(args.engine_args)]
            print("+", shlex.join(cmd), flush=True)
            if subprocess.run(cmd).returncode != 0 or not out.is_file():
                errors[name] = "pagedserve bench throughput failed (see the log)"
                continue
            doc = json.loads(out.read_text())
            results[name] = doc["results"]
            switches = doc.get("switches", switches)
            if "roofline_fraction" in doc.get("ratios", {}):
                ratios[f"{name}_roofline_fraction"] = doc["ratios"]["roofline_fraction"]
            if args.vllm_dir:
                theirs = vllm_rate(Path(args.vllm_dir) / f"vllm_{run}.json")
                if theirs:
                    results[name]["vllm_output_tokens_per_s"] = theirs
                    ratios[f"{name}_over_vllm"] = round(results[name]["output_tokens_per_s"] / theirs, 3)
    if errors:
        results["errors"] = errors
    config = {"models": args.models, "workloads": args.workloads, "load_format": "dummy", "dtype": "bfloat16",
              "engine_args": args.engine_args}
    if args.merge and Path(args.output).is_file():
        old = json.loads(Path(args.output).read_text())
        results = {**{k: v for k, v in old.get("results", {}).items() if k != "errors"}, **results}
        ratios = {**old.get("ratios", {}), **ratios}
        config["merged_runs"] = {**old.get("config", {}).get("merged_runs", {}),
                                 **{f"{m}_{w}{'_' + args.tag if args.tag else ''}": git_commit()
                                    for m in args.models for w in args.workloads}}
    write_result(args.output, "moe", None, config, results, {}, ratios, switches=switches)
    print(json.dumps({"results": results, "ratios": ratios}, indent=2))


if __name__ == "__main__":
    main()
