"""A/B of one mixed step (decodes beside a prefill chunk): full graph vs piecewise graphs vs eager.

Why: with cudagraph_mode="piecewise" a step with prefill tokens replays graph pieces with attention
launched eagerly between them (runner/piecewise_graphs.py); with "full" it replays one graph
whose attention is the unified kernel (runner/full_graphs.py). This times the same steps both
ways on one ModelRunner (Llama-3.1-8B's config, dummy weights, bf16, max_model_len 131072): its
full graphs and piecewise graphs are both captured, and each case runs with only
one of the two mixed-step paths left on. Block tables wrap around a pool of --num-blocks blocks
(the K/V read is garbage, the time is not). Per case: the path the runner took, the median and
p90 of --iters steps (CUDA events around execute_model, after 3 warm-up steps), and the largest
difference of the sampled rows' logits between the paths (both in bf16: a sanity check, not a
test). Needs CUDA.

  python benchmarks/kernels/mixed_step_ab.py --output $OUT/mixed_step_ab.json
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from pagedserve.config import EngineConfig  # noqa: E402
from pagedserve.models.loader import load_hf_config  # noqa: E402
from pagedserve.runner.batch import HostBatch  # noqa: E402
from pagedserve.runner.model_runner import ModelRunner  # noqa: E402
from pagedserve.runner.step_input import StepInput  # noqa: E402

# (name, decodes, decode context, chunk tokens, chunk start): serving's mixed steps, short to long.
CASES = [
    ("d64x4k+c512@16k", 64, 4096, 512, 16384),
    ("d128x1k+c256@0", 128, 1024, 256, 0),
    ("d16x8k+c256@100k", 16, 8192, 256, 100_000),
    ("d32x2k+c1024@32k", 32, 2048, 960, 32768),
    ("d8x32k+c2048@64k", 8, 32768, 2048, 65536),
    ("d200x2k+c64@1k", 200, 2048, 64, 1024),
]


def build_runner(args) -> ModelRunner:
    cfg = EngineConfig(model=args.model, load_format="dummy", dtype="bfloat16", device="cuda",
                       max_model_len=args.max_model_len, max_num_seqs=256, max_num_batched_tokens=args.max_tokens,
                       num_gpu_blocks_override=args.num_blocks, swap_space=0, block_size=16)
    runner = ModelRunner(cfg, load_hf_config(args.model), torch.device("cuda", 0), torch.bfloat16)
    runner.load_model()
    runner.allocate_kv_cache(args.num_blocks, 0)
    # No decode graphs: no case is decode-only, and decode rows are off below.
    t1 = time.perf_counter()
    cfg.cudagraph_mode = "full"
    runner.capture_full_graphs()
    t2 = time.perf_counter()
    cfg.cudagraph_mode = "piecewise"
    runner.capture_piecewise_graphs()
    t3 = time.perf_counter()
    runner.profile.update(capture_full_s=t2 - t1, capture_piecewise_s=t3 - t2)
    return runner


def step_input(runner: ModelRunner, decodes: int, ctx: int, chunk: int, start: int) -> StepInput:
    bs, nb = runner.block_size, runner.cache_engine.num_gpu_blocks
    seqs = [(ctx - 1, 1)] * decodes + [(start, chunk)]
    tables = [[(7919 * i + j) % nb for j in range(-(-(s + q) // bs))] for i, (s, q) in enumerate(seqs)]
    total = sum(q for _, q in seqs)
    ids = (np.arange(total, dtype=np.int64) * 7919 + 11) % runner.vocab_size
    batch = HostBatch(ids, np.array([s for s, _ in seqs], dtype=np.int64), np.array([q for _, q in seqs], dtype=np.int64),
                      tables, np.ones(len(seqs), dtype=bool), decodes)
    return StepInput([], [], [], batch)


def time_path(runner: ModelRunner, step: StepInput, iters: int) -> tuple[str, list[float], torch.Tensor]:
    for _ in range(3):
        logits = runner.execute_model(step)
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        logits = runner.execute_model(step)
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return runner.last_graph_path, times, logits.float()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=str(ROOT / "benchmarks/models/llama-3.1-8b"))
    ap.add_argument("--max-model-len", type=int, default=131072)
    ap.add_argument("--max-tokens", type=int, default=4096, help="max_num_batched_tokens (the largest full bucket)")
    ap.add_argument("--num-blocks", type=int, default=16384)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--cases", default=None, help="comma-separated case names (default: all)")
    ap.add_argument("--output", default=None)
    args = ap.parse_args()
    t0 = time.perf_counter()
    runner = build_runner(args)
    runner.short_prefill_graphs = False  # decode rows would take the short chunks: compare the two paths
    full, piecewise = runner.full_graphs, runner.piecewise
    print(f"set up in {time.perf_counter() - t0:.0f} s: {json.dumps(runner.profile)}", flush=True)
    results = {}
    wanted = set(args.cases.split(",")) if args.cases else None
    for name, decodes, ctx, chunk, start in CASES:
        if wanted and name not in wanted:
            continue
        step = step_input(runner, decodes, ctx, chunk, start)
        row = {"tokens": decodes + chunk, "decodes": decodes, "decode_context": ctx, "chunk": chunk, "chunk_start": start}
        outs = {}
        for mode, (f, p) in {"full": (full, None), "piecewise": (None, piecewise), "eager": (None, None)}.items():
            runner.full_graphs, runner.piecewise = f, p
            path, times, logits = time_path(runner, step, args.iters)
            outs[mode] = logits
            row[mode] = {"path": path, "ms_p50": round(statistics.median(times), 3),
                         "ms_p90": round(float(np.percentile(times, 90)), 3)}
        runner.full_graphs, runner.piecewise = full, piecewise
        row["full_over_piecewise_p50"] = round(row["full"]["ms_p50"] / row["piecewise"]["ms_p50"], 3)
        row["full_over_eager_p50"] = round(row["full"]["ms_p50"] / row["eager"]["ms_p50"], 3)
        row["max_logit_diff_full_vs_eager"] = float((outs["full"] - outs["eager"]).abs().max())
        results[name] = row
        print(name, json.dumps(row), flush=True)
    out = {"device": torch.cuda.get_device_name(0), "model": args.model, "max_model_len": args.max_model_len,
           "max_num_batched_tokens": args.max_tokens, "profile": runner.profile, "cases": results}
    if args.output:
        Path(args.output).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
