"""Offline throughput of the MoE models (dummy weights of their real configs, bf16), ours:
`pagedserve bench throughput` for each model x workload, each in its own process, collected
into one result (default benchmarks/results/h200/moe.json) with the roofline fraction that
counts the experts each step touches (pagedserve/benchmark/roofline.py).

    python benchmarks/offline/moe_offline.py [--models qwen3-30b-a3b mixtral-8x7b] [--workloads nanovllm fixed256] \
        [--vllm-dir DIR] [--engine-args "..."] [--merge] --output benchmarks/results/h200/moe.json

One model x workload fits a 10-minute device call; --merge adds each to the same file (the
commit of each merged run is kept in config.merged_runs).
--one-engine: each model's workloads on one LLM in this process (moe_engine_runs.py: one start-up
per model, and the nanovllm run's decode-step roofline fraction from a step trace); --repeats 1
times only the cold first run, the one compared with vLLM's single run (like_for_like).

--vllm-dir: a folder of vLLM's results of the same runs, vllm_<model>_<workload>.json as written by
benchmarks/serving/peers/bench_vllm.py --workload W --config benchmarks/models/<model>/config.json --tag <model>;
each found gives the ratio <model>_<workload>_over_vllm (output tokens/s, ours over theirs, run for
run: see like_for_like). --ratios-only recomputes them for an existing --output (CPU is fine).
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


def vllm_runs(path: Path) -> list[float]:
    """Output tokens/s of each timed run in a bench_vllm.py JSON (results.runs), in order."""
    if not path.is_file():
        return []
    res = json.loads(path.read_text()).get("results", {})
    return [float(r["output_tok_s"]) for r in res.get("runs", [])] or (
        [float(res["output_tok_s"])] if isinstance(res.get("output_tok_s"), (int, float)) else [])


def like_for_like(ours: dict, theirs: list[float]) -> tuple[float, float, str] | None:
    """(ours, theirs, which) compared run for run. Our runs repeat the same prompts, so the second
    finds them in the prefix cache; a single vLLM run had no such help. So: with one vLLM run, our
    first (cold) run; with several on both sides, each side's best (both warm)."""
    runs = [r["output_tokens_per_s"] for r in ours.get("runs", [])] or [ours["output_tokens_per_s"]]
    if not theirs:
        return None
    if len(theirs) == 1 or len(runs) == 1:
        return runs[0], theirs[0], "first run each (prefix cache cold on both sides)"
    return max(runs), max(theirs), "best run each (repeats hit the prefix cache on both sides)"


def add_vllm_ratio(results: dict, ratios: dict, name: str, run: str, vllm_dir: Path) -> None:
    pair = like_for_like(results[name], vllm_runs(vllm_dir / f"vllm_{run}.json"))
    if pair:
        ours, theirs, which = pair
        results[name].update(vllm_output_tokens_per_s=theirs, compared_output_tokens_per_s=ours,
                             vllm_comparison=which)
        ratios[f"{name}_over_vllm"] = round(ours / theirs, 3)


def recompute_ratios(output: Path, vllm_dir: Path) -> None:
    """--ratios-only: the *_over_vllm ratios of an existing result from --vllm-dir, no GPU needed."""
    doc = json.loads(output.read_text())
    for name, res in doc["results"].items():
        if isinstance(res, dict) and "output_tokens_per_s" in res:
            run = name.split("_tp")[0]
            add_vllm_ratio(doc["results"], doc["ratios"], name, run, vllm_dir)
    doc["config"]["vllm_dir"] = str(vllm_dir.resolve().relative_to(ROOT)) if vllm_dir.resolve().is_relative_to(ROOT) \
        else str(vllm_dir)
    doc["ratios_recomputed_by"] = "python benchmarks/offline/moe_offline.py " + shlex.join(sys.argv[1:])
    output.write_text(json.dumps(doc, indent=2) + "\n")
    print(json.dumps(doc["ratios"], indent=2))


def engine_kwargs(model_dir: Path, engine_args: str) -> dict:
    """LLM(...) keyword arguments as `pagedserve bench throughput` gives them: max_model_len 4096 (or
    the model's own limit when shorter) and the flags of --engine-args."""
    from pagedserve.engine_args import add_engine_args, changed_engine_kwargs
    from pagedserve.models.loader import get_max_model_len, load_hf_config
    p = argparse.ArgumentParser()
    add_engine_args(p)
    return {"max_model_len": min(4096, get_max_model_len(load_hf_config(str(model_dir)))),
            **changed_engine_kwargs(p.parse_args(shlex.split(engine_args)))}


def one_engine(args, model: str, results: dict, ratios: dict, errors: dict, save) -> dict | None:
    """--one-engine: the model's workloads on one LLM here; fills results/ratios under the usual names
    and calls save(switches) after each workload (a time limit keeps what finished)."""
    from moe_engine_runs import run_workloads
    model_dir = Path(model) if Path(model).is_dir() else ROOT / "benchmarks/models" / model
    model = model_dir.name
    suffix = f"_{args.tag}" if args.tag else ""

    def take(out: dict) -> None:
        for wl, res in out["results"].items():
            results[f"{model}_{wl}{suffix}"] = res
            if args.vllm_dir:
                add_vllm_ratio(results, ratios, f"{model}_{wl}{suffix}", f"{model}_{wl}", Path(args.vllm_dir))
        for key, value in out["ratios"].items():  # <workload>_[decode_]roofline_fraction
            wl, _, what = key.partition("_")
            ratios[f"{model}_{wl}{suffix}_{what}"] = value
        errors.update({f"{model}_{wl}{suffix}": msg for wl, msg in out["errors"].items()})
        save(out["switches"])
    try:
        out = run_workloads(str(model_dir), args.workloads, engine_kwargs(model_dir, args.engine_args), args.repeats,
                            num_requests=args.num_requests, on_workload=take)
    except Exception as e:  # noqa: BLE001  (the engine did not start: say so in the file)
        errors[model] = f"{type(e).__name__}: {str(e)[:500]}"
        return None
    return out["switches"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", nargs="+", default=list(MODELS))
    ap.add_argument("--workloads", nargs="+", default=["nanovllm", "fixed256"])
    ap.add_argument("--engine-args", default="", help="extra flags for `pagedserve bench throughput`")
    ap.add_argument("--vllm-dir", default=None)
    ap.add_argument("--one-engine", action="store_true",
                    help="each model's workloads on one LLM in this process (one start-up; decode-step roofline)")
    ap.add_argument("--repeats", type=int, default=2, help="timed runs per workload (1: the cold run only)")
    ap.add_argument("--num-requests", type=int, default=None, help="fewer requests (CPU tests)")
    ap.add_argument("--tag", default="", help="suffix of the result names (e.g. tp2, tp2_ep)")
    ap.add_argument("--output", default=str(ROOT / "benchmarks/results/h200/moe.json"))
    ap.add_argument("--merge", action="store_true",
                    help="keep the other runs already in --output (one model x workload per device call)")
    ap.add_argument("--ratios-only", action="store_true",
                    help="recompute the *_over_vllm ratios of --output from --vllm-dir (no GPU, no runs)")
    args = ap.parse_args()
    if args.ratios_only:
        recompute_ratios(Path(args.output), Path(args.vllm_dir))
        return
    git_commit()  # refuse before measuring
    tmp = Path(tempfile.mkdtemp())
    results, ratios, switches, errors = {}, {}, {}, {}

    def save(run_switches: dict | None = None) -> None:
        nonlocal switches
        switches = run_switches or switches
        write(args, results, ratios, switches, errors)
    for model in args.models:
        if args.one_engine:
            one_engine(args, model, results, ratios, errors, save)
            continue
        for workload in args.workloads:
            run = f"{model}_{workload}"
            name = f"{run}_{args.tag}" if args.tag else run
            out = tmp / f"{name}.json"
            cmd = [sys.executable, "-m", "pagedserve.entrypoints.cli", "bench", "throughput", "--workload", workload,
                   "--model", str(ROOT / "benchmarks/models" / model), "--output", str(out),
                   "--repeats", str(args.repeats),
                   *(["--num-requests", str(args.num_requests)] if args.num_requests else []),
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
                add_vllm_ratio(results, ratios, name, run, Path(args.vllm_dir))
    save()
    print(json.dumps({"results": results, "ratios": ratios, "errors": errors}, indent=2))


def write(args, results: dict, ratios: dict, switches: dict, errors: dict) -> None:
    """--output from this run's figures (with --merge: over the file's earlier ones, read once, before
    this run wrote anything)."""
    results = {**results, **({"errors": errors} if errors else {})}
    config = {"models": args.models, "workloads": args.workloads, "load_format": "dummy", "dtype": "bfloat16",
              "engine_args": args.engine_args, "repeats": args.repeats, "one_engine": args.one_engine}
    if args.merge:
        if not hasattr(args, "merged_from"):
            path = Path(args.output)
            args.merged_from = json.loads(path.read_text()) if path.is_file() else None
        old = args.merged_from
        if old is not None:
            results = {**{k: v for k, v in old.get("results", {}).items() if k != "errors"}, **results}
            ratios = {**old.get("ratios", {}), **ratios}
            config["merged_runs"] = {**old.get("config", {}).get("merged_runs", {}),
                                     **{f"{m}_{w}{'_' + args.tag if args.tag else ''}": git_commit()
                                        for m in args.models for w in args.workloads}}
    write_result(args.output, "moe", None, config, results, {}, ratios, switches=switches)


if __name__ == "__main__":
    main()
