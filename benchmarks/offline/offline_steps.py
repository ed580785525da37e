"""Where an offline run's time goes, step by step: device time against the roofline's ideal.

Runs a `pagedserve bench throughput` workload as that command does (dummy weights, the same
engine defaults, a warm-up of the timed shapes, one run that fills the prefix cache), then one
more run with a step trace (pagedserve/engine/step_trace.py: each step's shape, the KV positions
its attention reads, its device busy time and the device's idle time before it). Each step's
ideal is the roofline's (pagedserve/benchmark/roofline.py: max(bytes / copy bandwidth,
FLOPs / matmul rate), bytes = weights + every context token's KV) on this device.

Reports the run's wall time split into device busy and device idle (waiting for the host), and
per group (decode-only steps by batch size, steps with prefill by token count): steps, busy
and ideal seconds, the ideal's fraction of busy, and the group's share of the run. Groups with a
low fraction and a large share are where the run loses to the roofline. Needs CUDA.

  python benchmarks/offline/offline_steps.py --workload nanovllm --output /tmp/offline_steps_nanovllm.json
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from pagedserve import LLM  # noqa: E402
from pagedserve.benchmark.hardware import (measure_copy_bandwidth, measure_fp8_matmul_rate,  # noqa: E402
                                          measure_matmul_rate)
from pagedserve.benchmark.results import engine_switches, git_commit, write_result  # noqa: E402
from pagedserve.benchmark.roofline import ModelCost  # noqa: E402
from pagedserve.benchmark.throughput import default_model, timed_generate, warm_up_requests  # noqa: E402
from pagedserve.engine.step_trace import StepTrace  # noqa: E402
from pagedserve.workloads import make_workload  # noqa: E402


def step_ideal_s(step: dict, cost: ModelCost, bandwidth: float, flops_rate: float,
                 fp8_flops_rate: float | None = None) -> float:
    """The roofline of one traced step. The trace holds no per-query contexts: a decode's query
    attends to its whole context (exact); a step with prefill is charged tokens x mean context
    pairs, and the lm head for every sequence (both upper bounds; decode steps dominate offline)."""
    nbytes = cost.step_weight_bytes(step["tokens"]) + step["context"] * cost.kv_bytes_per_token
    pairs = step["context"] if step["tokens"] == step["decodes"] else step["tokens"] * step["context"] // step["seqs"]
    compute = cost.step_flops_seconds(step["tokens"], step["seqs"], pairs, flops_rate, fp8_flops_rate)
    return max(nbytes / bandwidth, compute)


def group_key(step: dict, bin_seqs: int, bin_tokens: int) -> str:
    if step["tokens"] == step["decodes"]:
        lo = (step["seqs"] - 1) // bin_seqs * bin_seqs + 1
        return f"decode {lo}-{lo + bin_seqs - 1}"
    lo = (step["tokens"] - 1) // bin_tokens * bin_tokens + 1
    return f"mixed {lo}-{lo + bin_tokens - 1} tokens"


def summarise(steps: list[dict], wall_s: float, cost: ModelCost, bandwidth: float, flops_rate: float,
              bin_seqs: int, bin_tokens: int, fp8_flops_rate: float | None = None) -> dict:
    groups: dict[str, list[dict]] = defaultdict(list)
    for s in steps:
        if s["seqs"]:
            groups[group_key(s, bin_seqs, bin_tokens)].append(s)
    busy_total = sum(s["busy_ms"] for s in steps) / 1e3
    out = {}
    for key in sorted(groups, key=lambda k: (k.split()[0], int(k.split()[1].split("-")[0]))):
        g = groups[key]
        busy = sum(s["busy_ms"] for s in g) / 1e3
        ideal = sum(step_ideal_s(s, cost, bandwidth, flops_rate, fp8_flops_rate) for s in g)
        out[key] = {"steps": len(g), "mean_seqs": round(sum(s["seqs"] for s in g) / len(g), 1),
                    "mean_context": round(sum(s["context"] for s in g) / len(g)),
                    "busy_s": round(busy, 4), "ideal_s": round(ideal, 4),
                    "ideal_over_busy": round(ideal / busy, 3) if busy else None,
                    "share_of_busy": round(busy / busy_total, 3) if busy_total else None,
                    "busy_ms_per_step": round(busy * 1e3 / len(g), 3)}
    gaps = sum(s["gap_ms"] or 0.0 for s in steps) / 1e3
    ideal_total = sum(step_ideal_s(s, cost, bandwidth, flops_rate, fp8_flops_rate) for s in steps if s["seqs"])
    return {"wall_s": round(wall_s, 3), "steps": len(steps), "busy_s": round(busy_total, 3),
            "gap_s": round(gaps, 4), "ideal_s": round(ideal_total, 3),
            "ideal_over_busy": round(ideal_total / busy_total, 3) if busy_total else None,
            # wall time neither busy nor waiting between steps: before the first step and after the last
            "outside_steps_s": round(wall_s - busy_total - gaps, 3), "groups": out}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workload", default="nanovllm")
    ap.add_argument("--model", default=None, help="default: the workload's config in benchmarks/models/")
    ap.add_argument("--num-requests", type=int, default=None)
    ap.add_argument("--bin-seqs", type=int, default=32)
    ap.add_argument("--bin-tokens", type=int, default=2048)
    ap.add_argument("--keep-trace", default=None, help="also copy the step trace (jsonl) here")
    ap.add_argument("--output", default=None)
    ap.add_argument("--engine-arg", action="append", default=[], metavar="FIELD=VALUE",
                    help="an EngineConfig field for the engine (a JSON value, else a string), e.g. "
                         "nano_batch_rows=512; repeatable")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("offline_steps.py needs CUDA", file=sys.stderr)
        return 2
    if args.output:
        git_commit()
    model = args.model or default_model(args.workload)
    kwargs = {"max_model_len": 4096}
    for item in args.engine_arg:
        field, _, value = item.partition("=")
        try:
            kwargs[field] = json.loads(value)
        except json.JSONDecodeError:
            kwargs[field] = value
    reqs = make_workload(args.workload, args.num_requests)
    llm = LLM(model, load_format="dummy", skip_tokenizer_init=True, **kwargs)
    timed_generate(llm, warm_up_requests(reqs))
    first = timed_generate(llm, reqs)  # fills the prefix cache, as bench throughput's first run
    path = args.keep_trace or os.path.join(tempfile.mkdtemp(), "steps.jsonl")
    if os.path.exists(path):
        os.remove(path)
    trace = StepTrace(path)
    llm.llm_engine.step_timer = trace
    traced = timed_generate(llm, reqs)
    torch.cuda.synchronize()
    trace.flush(idle=True)
    steps = [json.loads(x) for x in Path(path).read_text().splitlines()]
    bandwidth, flops_rate = measure_copy_bandwidth(), measure_matmul_rate()
    cost = ModelCost.for_engine(llm.llm_engine)
    fp8_rate = measure_fp8_matmul_rate() if cost.fp8_matmul_params else None
    summary = summarise(steps, traced.seconds, cost, bandwidth, flops_rate, args.bin_seqs, args.bin_tokens, fp8_rate)
    results = {"untraced_run_s": round(first.seconds, 3), "traced_run_s": round(traced.seconds, 3),
               "output_tokens": traced.output_tokens, "copy_bandwidth_GBps": round(bandwidth / 1e9, 1),
               "matmul_TFLOPs": round(flops_rate / 1e12, 1), **summary}
    if fp8_rate:
        results["fp8_matmul_TFLOPs"] = round(fp8_rate / 1e12, 1)
    print(json.dumps(results, indent=1))
    if args.output:
        write_result(args.output, "offline_steps", "python benchmarks/offline/offline_steps.py " + shlex.join(sys.argv[1:]),
                     {"model": model, "workload": args.workload, **kwargs}, results, {}, {},
                     switches=engine_switches(llm.llm_engine.config))
    return 0


if __name__ == "__main__":
    t0 = time.perf_counter()
    rc = main()
    print(f"offline_steps.py: {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    sys.exit(rc)
