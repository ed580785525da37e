"""Which CUDA kernels one decode step runs, and for how long, with the fused layer ops on and off.

Builds an LLMEngine (eager: enforce_eager=True, so every kernel shows in the profiler) with
--num-seqs running sequences, steps until all of them are decodes, then for each mode
(PAGEDSERVE_FUSED=1: Triton fused norms / rotary / silu-mul; =0: plain torch) warms up, times
--steps steps with the wall clock, and records --steps more under torch.profiler. Per mode the
result holds kernels per step, kernel time per step (the sum of kernel durations: device busy
time, host gaps excluded), the device's idle time per step (the profiled window minus the union
of all device activity: the time the GPU waited for the host, launch gaps of eager mode
included) and the top kernels by time. Needs CUDA.

  python benchmarks/kernels/profile_decode.py                      # Qwen3-0.6B, dummy weights, 256 seqs
  python benchmarks/kernels/profile_decode.py --no-async-scheduling   # synchronous steps, for the A/B
  python benchmarks/kernels/profile_decode.py --cuda-graphs   # as serving runs: decode graphs replayed,
      # fused ops only; "wall ms/step" is then the step period, and GPU idle holds the gaps between
      # replayed kernels and any wait for the host; gpu_idle_by_gap_length tells the two apart
      # (a few us per launch gap inside a graph, tens of us and more for a wait for the host)
  python benchmarks/kernels/profile_decode.py --cuda-graphs --trace-dir /tmp/t   # + Chrome traces of the steps
"""
from __future__ import annotations

import argparse
import os
import shlex
import sys
import time
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from pagedserve.benchmark.results import engine_switches, git_commit, write_result  # noqa: E402
from pagedserve.engine.llm_engine import LLMEngine, make_engine_config  # noqa: E402
from pagedserve.layers import fused  # noqa: E402

sys.path.insert(0, str(ROOT / "benchmarks" / "offline"))
from host_overhead import all_decoding, fill_decode_batch  # noqa: E402  (benchmarks/offline/)

MODES = {"fused": "1", "torch": "0"}


# Gap lengths that tell launch gaps inside a replayed graph (a few us each) from waits for the
# host between launches (sampling, the next step's inputs: tens of us and more).
GAP_BUCKETS_US = ((0.0, 5.0), (5.0, 50.0), (50.0, float("inf")))


def idle_gaps(spans: list[tuple[float, float]]) -> list[float]:
    """The device's idle intervals (us) between sorted (start, end) activity spans, overlaps merged."""
    gaps, reach = [], spans[0][1] if spans else 0.0
    for start, end in spans[1:]:
        if start > reach:
            gaps.append(start - reach)
        reach = max(reach, end)
    return gaps


def gap_buckets(gaps: list[float], steps: int) -> dict:
    """Per step: how many idle gaps of each length bucket (GAP_BUCKETS_US), and their ms."""
    out = {}
    for lo, hi in GAP_BUCKETS_US:
        inside = [g for g in gaps if lo <= g < hi]
        name = f"{lo:g}-{hi:g}us" if hi != float("inf") else f">={lo:g}us"
        out[name] = {"count_per_step": round(len(inside) / steps, 2),
                     "ms_per_step": round(sum(inside) / steps / 1e3, 4)}
    return out


def _kernel_table(prof, steps: int, top: int) -> dict:
    """Device activity from the profiler, per step: kernels apart from memcpy/memset."""
    per_name: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            per_name[e.name][0] += 1
            per_name[e.name][1] += e.time_range.elapsed_us()
    # "nccl:all_reduce" and the like are c10d's ranges on the device timeline, spanning the NCCL
    # kernel that is counted already: left out, or every collective counts twice.
    per_name = {k: v for k, v in per_name.items() if not k.startswith("nccl:")}
    kernels = {k: v for k, v in per_name.items() if not k.startswith(("Memcpy", "Memset"))}
    copies = {k: v for k, v in per_name.items() if k not in kernels}
    total_us = sum(t for _, t in kernels.values())
    spans = sorted((e.time_range.start, e.time_range.end) for e in prof.events()
                   if e.device_type == torch.autograd.DeviceType.CUDA)
    gaps = idle_gaps(spans)
    idle_us = sum(gaps)
    ranked = sorted(kernels.items(), key=lambda kv: -kv[1][1])[:top]
    return {
        "kernels_per_step": round(sum(c for c, _ in kernels.values()) / steps, 2),
        "kernel_ms_per_step": round(total_us / steps / 1e3, 4),
        "memcpy_memset_per_step": round(sum(c for c, _ in copies.values()) / steps, 2),
        "memcpy_memset_ms_per_step": round(sum(t for _, t in copies.values()) / steps / 1e3, 4),
        "distinct_kernels": len(kernels),
        "gpu_idle_ms_per_step": round(idle_us / steps / 1e3, 4),
        "gpu_idle_by_gap_length": gap_buckets(gaps, steps),
        "top_kernels": [{"name": name[:200], "calls_per_step": round(c / steps, 2),
                         "us_per_step": round(t / steps, 2), "us_per_call": round(t / c, 3),
                         "share": round(t / total_us, 4)} for name, (c, t) in ranked],
    }


def _profile_mode(engine: LLMEngine, n: int, args, mode: str) -> dict:
    for _ in range(args.warmup):  # Triton compiles on the first fused step
        engine.step(final_only=True)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(args.steps):
        engine.step(final_only=True)
    torch.cuda.synchronize()
    wall_ms = (time.perf_counter() - start) / args.steps * 1e3
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(args.steps):
            engine.step(final_only=True)
        torch.cuda.synchronize()
    if not all_decoding(engine, n):
        raise RuntimeError("a sequence stopped or was preempted while profiling: raise --max-model-len")
    if args.trace_dir:
        os.makedirs(args.trace_dir, exist_ok=True)
        prof.export_chrome_trace(os.path.join(args.trace_dir, f"{mode}.json.gz"))
    wall_key = "graph_wall_ms_per_step" if args.cuda_graphs else "eager_wall_ms_per_step"
    return {wall_key: round(wall_ms, 4), **_kernel_table(prof, args.steps, args.top)}


def _table(results: dict, command: str) -> str:
    lines = ["# profile_decode", "", f"`{command}`", "",
             "| mode | kernels/step | kernel ms/step | wall ms/step | GPU idle ms/step |",
             "|---|---|---|---|---|"]
    for mode, r in results.items():
        wall = r.get("eager_wall_ms_per_step", r.get("graph_wall_ms_per_step"))
        label = "eager" if "eager_wall_ms_per_step" in r else "graphs"
        lines.append(f"| {mode} ({label}) | {r['kernels_per_step']} | {r['kernel_ms_per_step']} | {wall} "
                     f"| {r['gpu_idle_ms_per_step']} |")
    for mode, r in results.items():
        lines += ["", f"## top kernels, {mode}", "", "| kernel | calls/step | us/step | share |", "|---|---|---|---|"]
        lines += [f"| `{k['name'][:90]}` | {k['calls_per_step']} | {k['us_per_step']} | {k['share']} |"
                  for k in r["top_kernels"]]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=str(ROOT / "benchmarks/models/qwen3-0.6b"))
    ap.add_argument("--load-format", default="dummy")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--num-seqs", type=int, default=256)
    ap.add_argument("--steps", type=int, default=5, help="timed steps, then as many profiled, per mode")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--prompt-len", default="100,400", help="lo,hi: uniform prompt lengths")
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--temperature", type=float, default=0.0,
                    help="every sequence's temperature (0: greedy; > 0: the plain temperature sampling path)")
    ap.add_argument("--tensor-parallel-size", type=int, default=1,
                    help="TP ranks; the profile is rank 0's (this process), whose collectives wait for the others")
    ap.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=True,
                    help="overlapped steps (the engine's default); --no-async-scheduling: synchronous steps")
    ap.add_argument("--cuda-graphs", action="store_true",
                    help="replay the decode CUDA graphs as serving does (fused ops only) instead of eager steps")
    ap.add_argument("--trace-dir", default=None,
                    help="also write each mode's profiled steps as a Chrome trace (DIR/<mode>.json.gz)")
    ap.add_argument("--output", default=None,
                    help="default benchmarks/results/h200/profile_decode.json (profile_decode_sync.json with "
                         "--no-async-scheduling)")
    args = ap.parse_args()
    git_commit()  # refuse before measuring, not after
    if args.output is None:
        name = "profile_decode.json" if args.async_scheduling else "profile_decode_sync.json"
        if args.cuda_graphs:
            name = name.replace(".json", "_graphs.json")
        if args.tensor_parallel_size > 1:
            name = name.replace(".json", f"_tp{args.tensor_parallel_size}.json")
        folder = "h200" if args.tensor_parallel_size == 1 else f"h200x{args.tensor_parallel_size}"
        args.output = str(ROOT / "benchmarks/results" / folder / name)
    if not torch.cuda.is_available():
        raise SystemExit("profile_decode.py profiles CUDA kernels and needs a CUDA GPU; torch.cuda.is_available() "
                         "is False here")

    engine = LLMEngine(make_engine_config(
        args.model, device="cuda", dtype=args.dtype, load_format=args.load_format, max_num_seqs=args.num_seqs,
        skip_tokenizer_init=True, max_model_len=args.max_model_len, enforce_eager=not args.cuda_graphs,
        async_scheduling=args.async_scheduling, tensor_parallel_size=args.tensor_parallel_size))
    n = args.num_seqs
    ramp = fill_decode_batch(engine, n, tuple(int(x) for x in args.prompt_len.split(",")),
                            temperature=args.temperature)
    saved = os.environ.get("PAGEDSERVE_FUSED")
    results = {}
    # The other ranks are processes of their own that read PAGEDSERVE_FUSED once, at spawn: at TP > 1
    # only the fused mode (the default) is profiled, so every rank runs the same kernels.
    # With CUDA graphs, the kernels were captured at start-up with the default (fused) ops.
    one = args.tensor_parallel_size > 1 or args.cuda_graphs
    modes = {"fused": MODES["fused"]} if one else MODES
    try:
        for mode, flag in modes.items():
            os.environ["PAGEDSERVE_FUSED"] = flag
            fused.reset()
            active = fused.fused_ops(engine.device) is not None
            if active != (mode == "fused"):
                raise RuntimeError(f"PAGEDSERVE_FUSED={flag} did not select the {mode} path (Triton missing?)")
            results[mode] = _profile_mode(engine, n, args, mode)
            print(f"{mode:6s} {results[mode]['kernels_per_step']:8.1f} kernels/step  "
                  f"{results[mode]['kernel_ms_per_step']:8.3f} kernel ms/step  "
                  f"{results[mode].get('eager_wall_ms_per_step', results[mode].get('graph_wall_ms_per_step')):8.3f} "
                  f"{'graph' if args.cuda_graphs else 'eager'} wall ms/step  "
                  f"{results[mode]['gpu_idle_ms_per_step']:8.3f} GPU idle ms/step; by gap length "
                  f"{results[mode]['gpu_idle_by_gap_length']}")
    finally:
        if saved is None:
            os.environ.pop("PAGEDSERVE_FUSED", None)
        else:
            os.environ["PAGEDSERVE_FUSED"] = saved
        fused.reset()
    ratios = {}
    if "torch" in results:
        f, t = results["fused"], results["torch"]
        ratios = {"kernels_fused_over_torch": round(f["kernels_per_step"] / t["kernels_per_step"], 4),
                  "kernel_time_fused_over_torch": round(f["kernel_ms_per_step"] / t["kernel_ms_per_step"], 4)}
    config = {"model": args.model, "load_format": args.load_format, "dtype": str(engine.dtype), "num_seqs": n,
              "prompt_len": args.prompt_len, "max_model_len": engine.max_model_len, "enforce_eager": not args.cuda_graphs,
              "steps": args.steps, "warmup": args.warmup, "ramp_steps": ramp, "temperature": args.temperature,
              "async_scheduling": engine.async_scheduling, "tensor_parallel_size": args.tensor_parallel_size,
              "note": "one engine; modes run one after the other, so contexts grow by a few tokens between them"}
    command = "python benchmarks/kernels/profile_decode.py " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    write_result(args.output, "profile_decode", command, config, results, {}, ratios, _table(results, command),
                 switches=engine_switches(engine.config))
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
