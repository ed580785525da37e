"""Tune the Triton W8A8 GEMM's block sizes and split-K on this GPU, per weight shape and token
bucket, and write the tables the kernel reads (N=..,K=..,device=...json, into --output-dir:
pagedserve/layers/quant/configs/ by default; benchmarks/fp8_h200.sh gemm_tune copies them to $OUT).

For each bucket M (TUNE_TOKENS) and shape (Llama-3.1-8B's four linears by default), every config of
a pruned search space runs once against cuBLASLt's output (a config off by more than a bf16
rounding, or one that fails to compile, is dropped), then is timed as serving runs it: one CUDA
graph of one launch per weight copy, enough copies (256 MB) that each launch streams its weight
from HBM, replayed 20 times, median microseconds per launch (graph_timing.py). Why graphs: decode
replays CUDA graphs, and at 1-64 tokens a GEMM (5-50 us) is as short as a Triton launch's host
cost, which do_bench (one launch at a time from Python) adds to Triton's time: the first H200
tables, tuned that way, had Triton at 36-43 us for o_proj at 1-64 tokens against cuBLASLt's 17 us,
where a graph had Triton at 0.64-0.97x cuBLASLt. The fastest config is kept, and cuBLASLt
(torch._scaled_mm) is timed the same way. The entry records both times and how they were taken:
"timing": "graph", or "launch" where a capture failed and do_bench timed both (a launch-timed
config never beats a graph-timed one: it could not run in serving's graphs either).
PAGEDSERVE_FP8_GEMM=auto runs Triton at a bucket only where it was faster (fp8_gemm_config).
A file is rewritten after every bucket, smallest buckets first across all shapes, so a run stopped
by --max-seconds (or the caller's timeout) keeps the decode buckets.

Bounded to finish in < 3 minutes on an H200: compiling dominates, and the kernels do not specialize
on M, so a config compiles once for every shape and bucket (~75 distinct configs). Timing is ~1000
graphs (configs x shapes x buckets), each a capture of 3-16 launches and 20 replays: a few ms at
1-64 tokens (where do_bench took 11+ ms a call), ~50 ms at 4096 (16 copies x 20 replays of a
~0.14 ms o_proj GEMM), ~10-20 s in all, about what do_bench took; so every bucket is graph-timed,
large ones included (no bucket stays on do_bench unless its capture fails).

    python benchmarks/kernels/tune_fp8_gemm.py [--shape 4096 14336 ...] [--tokens 1 2 4] [--max-seconds 150]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from pagedserve.layers.fused_moe.config import device_name  # noqa: E402
from pagedserve.layers.quant.fp8_gemm_config import CONFIG_DIR, KEYS, config_file_name  # noqa: E402
from pagedserve.layers.quant.fp8_ops import quantize_per_channel, quantize_per_token  # noqa: E402
from pagedserve.layers.quant.triton_fp8_gemm import triton_fp8_gemm  # noqa: E402
from pagedserve.layers.tuned_tables import write_table  # noqa: E402

from graph_timing import cold_copies, fastest, launch_us, timed_us  # noqa: E402  (benchmarks/kernels/)

# (N, K) of Llama-3.1-8B's linears: fused qkv, o, fused gate_up, down.
LLAMA_8B = ((6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336))
TUNE_TOKENS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)


def search_space(m: int, k: int) -> list[dict]:
    """Up to 64 tokens (a weight-streaming GEMM): one row block as tall as the bucket (16 at least),
    column blocks 32-128, K 128 deep (4 stages) or 256 (3), split-K 1-8 keeping >= 2 K steps a
    split. Beyond: square-ish tiles grouped by 8, no split, 8 warps on the big ones."""
    if m > 64:
        tiles = ((64, 128, 4), (128, 128, 8), (128, 256, 8), (64, 256, 8))
        return [dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=128, GROUP_M=8, SPLIT_K=1, num_warps=w, num_stages=s)
                for bm, bn, w in tiles for s in (3, 4)]
    block_m = max(16, m)
    out = []
    for bn in (32, 64, 128):
        for bk, stages in ((128, 4), (256, 3)):
            for split in (1, 2, 4, 8) if m <= 32 else (1, 2, 4):
                if -(-k // bk) // split >= 2:
                    out.append(dict(BLOCK_M=block_m, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=1, SPLIT_K=split,
                                    num_warps=4, num_stages=stages))
    return out


def cublas(xq, xs, wq, ws):
    return torch._scaled_mm(xq, wq.t(), scale_a=xs, scale_b=ws.view(1, -1), out_dtype=torch.bfloat16)


def rep_ms(m: int) -> int:
    """do_bench's repetitions (the fallback): longer where a GEMM is long."""
    return 10 if m <= 512 else 25


def table_entry(cfg: dict, triton_us: float, cublas_us: float, timing: str) -> dict:
    """A bucket's entry: the kernel's keys (fp8_gemm_config.KEYS), both times (auto's evidence),
    and how they were timed ("graph" | "launch")."""
    return {**{key: cfg[key] for key in KEYS}, "triton_us": round(triton_us, 2),
            "cublas_us": round(cublas_us, 2), "timing": timing}


def tune_one(m: int, copies: list, g) -> dict | None:
    """The fastest correct config at m tokens against the weight in `copies` (cold_copies), and
    cuBLASLt's time, taken the same way."""
    wq, ws = copies[0]
    n, k = wq.shape
    xq, xs = quantize_per_token(torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=g))
    ref = cublas(xq, xs, wq, ws).float()
    tol = 2 ** -6 * float(ref.abs().max())
    timed = []
    for cfg in search_space(m, k):
        def run(w, cfg=cfg):
            return triton_fp8_gemm(xq, xs, *w, torch.bfloat16, config=cfg)
        try:
            diff = float((run(copies[0]).float() - ref).abs().max())
        except Exception as e:  # out of shared memory / registers: not a candidate here
            print(f"  M={m} N={n} K={k} {cfg}: {type(e).__name__}", flush=True)
            continue
        if diff > tol:
            print(f"  M={m} N={n} K={k} {cfg}: off by {diff:.3g} (> {tol:.3g}), dropped", flush=True)
            continue
        timed.append((cfg, *timed_us(run, copies, rep_ms=rep_ms(m))))
    best = fastest(timed)
    if best is None:
        return None
    cfg, triton_us, timing = best
    cublas_us, cublas_timing = timed_us(lambda w: cublas(xq, xs, *w), copies, graph=timing == "graph",
                                        rep_ms=rep_ms(m))
    if cublas_timing != timing:  # cuBLASLt would not capture: time Triton's pick by do_bench too, so they compare
        triton_us, timing = launch_us(lambda: triton_fp8_gemm(xq, xs, wq, ws, torch.bfloat16, config=cfg),
                                      rep_ms(m)), "launch"
    return table_entry(cfg, triton_us, cublas_us, timing)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", type=int, nargs=2, action="append", metavar=("N", "K"),
                    help="a weight shape (repeatable); default: Llama-3.1-8B's four")
    ap.add_argument("--tokens", type=int, nargs="+", default=list(TUNE_TOKENS))
    ap.add_argument("--max-seconds", type=float, default=150, help="stop starting new buckets after this")
    ap.add_argument("--output-dir", default=str(CONFIG_DIR))
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("tune_fp8_gemm.py needs a CUDA GPU with FP8")
    dev = torch.device("cuda")
    os.makedirs(args.output_dir, exist_ok=True)
    g = torch.Generator(device=dev).manual_seed(0)
    shapes = [tuple(s) for s in args.shape] if args.shape else list(LLAMA_8B)
    weights = {(n, k): cold_copies(quantize_per_channel(0.02 * torch.randn(n, k, device=dev, generator=g)))
               for n, k in shapes}
    paths = {s: os.path.join(args.output_dir, config_file_name(*s, device_name(dev))) for s in shapes}
    tables = {s: json.load(open(p)) if os.path.isfile(p) else {} for s, p in paths.items()}
    t0 = time.time()
    for m in args.tokens:
        if time.time() - t0 > args.max_seconds:
            print(f"time limit: stopping before M={m}", flush=True)
            break
        for s in shapes:
            entry = tune_one(m, weights[s], g)
            if entry is None:
                print(f"M={m} N={s[0]} K={s[1]}: no config ran", flush=True)
                continue
            tables[s][str(m)] = entry
            print(f"M={m} N={s[0]} K={s[1]}: {entry} ({time.time() - t0:.0f} s)", flush=True)
            write_table(paths[s], tables[s])
    print("\n".join(paths.values()))


if __name__ == "__main__":
    main()
