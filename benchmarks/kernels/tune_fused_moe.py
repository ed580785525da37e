"""Tune the fused MoE grouped GEMM's block sizes on this GPU and write the table the layer reads
(pagedserve/layers/fused_moe/configs/E=..,H=..,I=..,dtype=..,device=...json).

For each token count, every config of a pruned search space runs the whole MoE (routing excluded:
sort/pad, gate/up GEMM, down GEMM, top-k sum) on random routings, timed with CUDA events by
triton.testing.do_bench; the fastest is kept. The file is rewritten after every token count, so a
run stopped by its time limit (--max-seconds, or the caller's timeout) keeps what it finished;
rerun with --tokens for the rest. Needs CUDA.

    python benchmarks/kernels/tune_fused_moe.py --model qwen3-30b-a3b [--tp 1] [--tokens 1 8 64 512]
"""
from __future__ import annotations

import argparse
import itertools
import json
import time

import torch
import triton

from moe_shapes import MODELS, TOKEN_COUNTS, layer_shape

from pagedserve.layers.fused_moe import triton_moe
from pagedserve.layers.fused_moe.config import CONFIG_DIR, KEYS, config_file_name, device_name


def search_space(num_tokens: int, num_experts: int, top_k: int) -> list[dict]:
    """Row blocks no taller than the rows an expert gets on average (x2), at least 16."""
    rows_per_expert = num_tokens * top_k / num_experts
    block_ms = [m for m in (16, 32, 64, 128) if m <= max(16, 2 * rows_per_expert)]
    out = []
    for m, n, k, g, w, s in itertools.product(block_ms, (32, 64, 128, 256), (64, 128), (1, 16), (4, 8), (3, 4)):
        if m * n >= 128 * 256 and w == 4:  # a big tile on 4 warps spills
            continue
        if g > 1 and num_tokens * top_k < 16 * m:  # too few row blocks for grouping to matter
            continue
        out.append(dict(BLOCK_M=m, BLOCK_N=n, BLOCK_K=k, GROUP_M=g, num_warps=w, num_stages=s))
    return out


def time_config(cfg, x, w13, w2, weights, ids) -> float:
    fn = lambda: triton_moe.fused_experts(x, w13, w2, weights, ids, cfg)  # noqa: E731
    return triton.testing.do_bench(fn, warmup=5, rep=25)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=MODELS[0], help=f"a benchmarks/models name or a config dir ({MODELS})")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--expert-parallel", action="store_true", help="the per-rank shape of whole experts per rank")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    ap.add_argument("--tokens", type=int, nargs="+", default=list(TOKEN_COUNTS))
    ap.add_argument("--max-seconds", type=float, default=540, help="stop starting new token counts after this")
    ap.add_argument("--output-dir", default=str(CONFIG_DIR))
    args = ap.parse_args()
    E, H, inter, top_k = layer_shape(args.model, args.tp, args.expert_parallel)
    dtype = getattr(torch, args.dtype)
    dev = torch.device("cuda")
    out_path = f"{args.output_dir}/{config_file_name(E, H, inter, dtype, device_name(dev))}"
    try:
        table = json.load(open(out_path))
    except FileNotFoundError:
        table = {}
    g = torch.Generator(device=dev).manual_seed(0)
    w13 = torch.randn(E, 2 * inter, H, generator=g, device=dev).mul_(H ** -0.5).to(dtype)
    w2 = torch.randn(E, H, inter, generator=g, device=dev).mul_(inter ** -0.5).to(dtype)
    t0 = time.time()
    for T in args.tokens:
        if time.time() - t0 > args.max_seconds:
            print(f"time limit: stopping before {T} tokens", flush=True)
            break
        x = torch.randn(T, H, generator=g, device=dev).to(dtype)
        weights, ids = triton_moe.route(torch.randn(T, E, generator=g, device=dev), top_k, True)
        weights = weights.to(dtype)
        best, best_ms = None, float("inf")
        for cfg in search_space(T, E, top_k):
            try:
                ms = time_config(cfg, x, w13, w2, weights, ids)
            except Exception as e:  # out of shared memory / registers: not a candidate here
                print(f"  T={T} {cfg}: {type(e).__name__}", flush=True)
                continue
            if ms < best_ms:
                best, best_ms = cfg, ms
        table[str(T)] = {k: best[k] for k in KEYS}
        print(f"T={T}: {best_ms * 1e3:.1f} us with {best}", flush=True)
        with open(out_path, "w") as f:
            json.dump(dict(sorted(table.items(), key=lambda kv: int(kv[0]))), f, indent=2)
            f.write("\n")
    print(out_path)


if __name__ == "__main__":
    main()
