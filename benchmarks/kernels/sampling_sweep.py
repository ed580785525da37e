"""The fused sampling kernel's launch (layers/triton_sampling.py) swept on the GPU: spans per row
(programs per SM), tokens a loop iteration reads (block) and warps, greedy and temperature 0.6,
microseconds a sample_rows call as decode graphs replay it.

Why: on the H200 (45th session, runs/s45_gpu/ in history.tar.gz) a temperature draw over 256 rows
of Qwen3's 151,936-token vocabulary took 184 us and greedy 86 us, where reading the bf16 logits
once takes ~18 us at copy bandwidth: ~3% of a nanovllm decode step. The launch was then two
programs per SM, block 2048, 8 warps; this sweep (46th session, runs/s46_gpu/ in
benchmarks/results/h200/history.tar.gz) made the default 16 per SM, 4 warps, block 2048 for
draws and 4096 for argmax.
Every variant draws the same tokens (the interpreter cases); `ratios` compare the best launch of
each shape with the module's default launch.

  python benchmarks/kernels/sampling_sweep.py --output /tmp/sampling_sweep.json
"""
from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from pagedserve.benchmark.results import write_result  # noqa: E402
from pagedserve.layers import triton_sampling as ts  # noqa: E402

from graph_timing import graph_us_per_launch  # noqa: E402  (benchmarks/kernels/)

SHAPES = ((256, 151936), (1000, 128256), (64, 128256), (8, 151936))  # rows, vocab: nanovllm, fixed256, serving


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--programs-per-sm", type=int, nargs="+", default=[2, 4, 8, 16])
    ap.add_argument("--block", type=int, nargs="+", default=[1024, 2048, 4096])
    ap.add_argument("--num-warps", type=int, nargs="+", default=[4, 8, 16])
    ap.add_argument("--output", default="/tmp/sampling_sweep.json")
    args = ap.parse_args()
    dev = torch.device("cuda")
    rows = []
    for n, vocab in SHAPES:
        x = torch.randn(n, vocab, device=dev, dtype=torch.bfloat16)
        temps = torch.full((n,), 0.6, device=dev)
        reference = {t is None: ts.sample_rows(x, t, seed=1)[0] for t in (temps, None)}
        for pps, block, warps in itertools.product(args.programs_per_sm, args.block, args.num_warps):
            splits = ts.split_count(n, vocab, dev, programs_per_sm=pps, block=block)
            for t in (temps, None):
                def launch():
                    ts.sample_rows(x, t, seed=1, splits=splits, block=block, num_warps=warps)
                tokens = ts.sample_rows(x, t, seed=1, splits=splits, block=block, num_warps=warps)[0]
                if not torch.equal(tokens, reference[t is None]):
                    raise AssertionError(f"{n}x{vocab} pps {pps} block {block} warps {warps}: other tokens")
                us = graph_us_per_launch(launch, replays=10, launches=8)
                rows.append({"rows": n, "vocab": vocab, "temperature": None if t is None else 0.6,
                             "programs_per_sm": pps, "splits": splits, "block": block, "num_warps": warps,
                             "us": round(us, 1), "GBps": round(n * vocab * 2 / us / 1e3, 1)})
                print(rows[-1], flush=True)
    best = {}
    for r in rows:
        key = f"{r['rows']}x{r['vocab']}_{'greedy' if r['temperature'] is None else 't0.6'}"
        if key not in best or r["us"] < best[key]["us"]:
            best[key] = r
    def is_default(r):
        block = ts.GREEDY_BLOCK if r["temperature"] is None else ts.BLOCK
        return (r["programs_per_sm"], r["block"], r["num_warps"]) == (ts.PROGRAMS_PER_SM, block, ts.NUM_WARPS)
    default = {f"{r['rows']}x{r['vocab']}_{'greedy' if r['temperature'] is None else 't0.6'}": r for r in rows
               if is_default(r)}
    ratios = {f"best_over_default_{k}": round(best[k]["us"] / default[k]["us"], 3) for k in best if k in default}
    write_result(args.output, "sampling_sweep", None, {"shapes": SHAPES, "dtype": "bfloat16",
                                                       "timing": "graph_timing.graph_us_per_launch"},
                 {"runs": rows, "best": best}, ratios=ratios)


if __name__ == "__main__":
    main()
