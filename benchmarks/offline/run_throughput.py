"""One workload side by side: pagedserve, then HF transformers (two ways), in one run.

Each engine runs in its own process so each gets the whole GPU. Writes
benchmarks/results/<device>/<workload>.json with the roofline fraction from pagedserve's own run
and two ratios against the faster HF path: vs_hf_transformers (pagedserve's best timed run; the
repeat finds the prompts in the prefix cache) and first_run_vs_hf_transformers (the first,
cache-cold timed run). baselines.hf_transformers.config says whether HF ran a subset.
"""
from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from pagedserve.benchmark.results import git_commit, write_result  # noqa: E402

# The bar, measured by the team on this same H200 (docs/benchmarks-history.md); not re-run here.
VLLM_SAME_H200 = {"nanovllm": {"output_tokens_per_s": 22009, "first_run_output_tokens_per_s": 18131},
                  "fixed256": {"requests_per_s": 88.7, "total_tokens_per_s": 45413}}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--workload", required=True, choices=["nanovllm", "fixed256"])
    ap.add_argument("--hf-requests", type=int, default=None, help="HF subset size (first N requests)")
    ap.add_argument("--hf-max-new-tokens", type=int, default=None)
    ap.add_argument("--hf-batch-size", type=int, default=256)
    ap.add_argument("--hf-modes", default="generate,generate_batch")
    ap.add_argument("--out-dir", default="benchmarks/results/h200")
    ap.add_argument("--engine-args", default="", help="extra flags for `pagedserve bench throughput`")
    args = ap.parse_args()
    git_commit()  # refuse before measuring, not after

    tmp = Path(tempfile.mkdtemp())
    ours_cmd = [sys.executable, "-m", "pagedserve.entrypoints.cli", "bench", "throughput", "--workload",
                args.workload, "--output", str(tmp / "ours.json"), *shlex.split(args.engine_args)]
    subprocess.run(ours_cmd, check=True)
    ours = json.loads((tmp / "ours.json").read_text())

    hf_cmd = [sys.executable, "benchmarks/offline/hf_baseline.py", "--workload", args.workload,
              "--model", ours["config"]["model"], "--batch-size", str(args.hf_batch_size),
              "--modes", args.hf_modes, "--output", str(tmp / "hf.json")]
    if args.hf_requests:
        hf_cmd += ["--num-requests", str(args.hf_requests)]
    if args.hf_max_new_tokens:
        hf_cmd += ["--max-new-tokens", str(args.hf_max_new_tokens)]
    hf = {}
    if subprocess.run(hf_cmd).returncode == 0:
        hf = json.loads((tmp / "hf.json").read_text())

    results, ratios = ours["results"], dict(ours["ratios"])
    hf_runs = hf.get("results", {})
    hf_rates = [hf_runs[m]["output_tokens_per_s"] for m in ("generate", "generate_batch")
                if isinstance(hf_runs.get(m), dict) and "output_tokens_per_s" in hf_runs[m]]
    if hf_rates:
        ratios["vs_hf_transformers"] = round(results["output_tokens_per_s"] / max(hf_rates), 2)
        ratios["first_run_vs_hf_transformers"] = round(results["runs"][0]["output_tokens_per_s"] / max(hf_rates), 2)
    bar = VLLM_SAME_H200[args.workload]
    key = "output_tokens_per_s" if args.workload == "nanovllm" else "requests_per_s"
    ratios["vs_vllm_same_h200"] = round(results[key] / bar[key], 3)
    baselines = {"hf_transformers": hf, "vllm_0.26_same_h200_from_BENCHMARKS_md": bar}
    command = "python benchmarks/offline/run_throughput.py " + shlex.join(sys.argv[1:])
    write_result(Path(args.out_dir) / f"{args.workload}.json", args.workload, command,
                 {**ours["config"], "pagedserve_command": ours["command"]}, results, baselines, ratios,
                 switches=ours["switches"])
    print(json.dumps({"results": results, "ratios": ratios}, indent=2))


if __name__ == "__main__":
    main()
