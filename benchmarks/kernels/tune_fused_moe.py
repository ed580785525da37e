"""Tune the fused MoE grouped GEMM's block sizes on this GPU and write the table the layer reads
(E=..,H=..,I=..,dtype=..,device=...json, into --output-dir: pagedserve/layers/fused_moe/configs/
by default; benchmarks/moe_run.sh writes into $OUT/configs and copies them there).

--dtype bfloat16 (or float16) tunes the bf16 experts; --dtype fp8_w8a8 the FP8 experts (W8A8:
per-token activation scales, per-channel weight scales; the file's key is vLLM's name for it).
For each token count, every config of a pruned search space runs the whole MoE (routing excluded:
activation quantization for fp8, sort/pad, gate/up GEMM, down GEMM, top-k sum) on random routings,
timed with CUDA events by triton.testing.do_bench; the fastest is kept. The file is rewritten after
every token count, so a run stopped by its time limit (--max-seconds, or the caller's timeout) keeps
what it finished; rerun with --tokens for the rest. Needs CUDA.

Sized to finish in about 4 minutes per model and dtype on an H200, where compiling dominates (each
config is two kernel variants, compiled once and reused across token counts): about 30 distinct
configs (search_space), 13 token counts (TUNE_TOKENS; the layer takes the nearest entry, so the
counts in between are served by their neighbours), do_bench at 3 warm-up and 20 ms of repetitions.
Measured offline: compiling all 34 fp8 configs (both variants) for sm_90 took 165 s on a slow
shared 2-core CPU; timing adds ~15 s. --max-seconds (200 in moe_run.sh) is the backstop.
Cut from the first version (which could not finish in a 10-minute call): BLOCK_K 32/256 outside
fp8's decode, GROUP_M other than 1 (decode) and 16 (larger), 8 warps on small tiles, stage counts
beyond 3-4, and the token counts 24, 48, 96, 1536 and 3072.

    python benchmarks/kernels/tune_fused_moe.py --model qwen3-30b-a3b [--dtype fp8_w8a8] [--tp 1] [--tokens 1 8 64 512]
"""
from __future__ import annotations

import argparse
import json
import os
import time

import torch
import triton

from moe_shapes import MODELS, layer_shape

from pagedserve.layers.fused_moe import triton_moe
from pagedserve.layers.fused_moe.config import CONFIG_DIR, KEYS, config_file_name, device_name
from pagedserve.layers.quant.fp8_ops import FP8_DTYPE, quantize_per_channel

TUNE_TOKENS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)


def search_space(num_tokens: int, num_experts: int, top_k: int, fp8: bool) -> list[dict]:
    """Decode-like counts (a few rows per expert): 16-row blocks, no grouping, the widths and depths
    that keep a thin GEMM streaming weights. Beyond: row blocks no taller than twice the rows an
    expert gets on average, grouped by 16, 8 warps on big tiles. fp8 reads K twice as deep per byte."""
    rows_per_expert = num_tokens * top_k / num_experts
    out = []
    if rows_per_expert <= 8:
        depths = (128, 256) if fp8 else (64, 128)
        for n in (32, 64, 128):
            for k in depths:
                for s in (3, 4):
                    out.append(dict(BLOCK_M=16, BLOCK_N=n, BLOCK_K=k, GROUP_M=1, num_warps=4, num_stages=s))
        if rows_per_expert > 2:
            return out + [dict(c, BLOCK_M=32) for c in out if c["BLOCK_N"] == 64]
        return out
    k = 128 if fp8 else 64
    for m in (m for m in (32, 64, 128) if m <= max(32, 2 * rows_per_expert)):
        for n in (64, 128, 256):
            for s in (3, 4):
                out.append(dict(BLOCK_M=m, BLOCK_N=n, BLOCK_K=k, GROUP_M=16, num_warps=8 if m * n > 64 * 128 else 4,
                                num_stages=s))
    return out


def make_experts(E: int, H: int, inter: int, dtype: str, dev: torch.device, g: torch.Generator) -> dict:
    """Random experts as fused_experts takes them: {w13, w2} (+ their scales for fp8)."""
    act = torch.bfloat16 if dtype == "fp8_w8a8" else getattr(torch, dtype)
    w13 = torch.randn(E, 2 * inter, H, generator=g, device=dev).mul_(H ** -0.5).to(act)
    w2 = torch.randn(E, H, inter, generator=g, device=dev).mul_(inter ** -0.5).to(act)
    if dtype != "fp8_w8a8":
        return {"w13": w13, "w2": w2}
    out = {}
    for name, w in (("w13", w13), ("w2", w2)):
        q = torch.empty(w.shape, dtype=FP8_DTYPE, device=dev)
        s = torch.empty(w.shape[:2], dtype=torch.float32, device=dev)
        for e in range(w.shape[0]):
            q[e], s[e] = quantize_per_channel(w[e])
        out[name], out[f"{name}_scale"] = q, s
    return out


def time_config(cfg, x, experts: dict, weights, ids) -> float:
    w = dict(experts)
    w13, w2 = w.pop("w13"), w.pop("w2")
    fn = lambda: triton_moe.fused_experts(x, w13, w2, weights, ids, cfg, **w)  # noqa: E731
    return triton.testing.do_bench(fn, warmup=3, rep=20)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=MODELS[0], help=f"a benchmarks/models name or a config dir ({MODELS})")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--expert-parallel", action="store_true", help="the per-rank shape of whole experts per rank")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "fp8_w8a8"],
                    help="the experts' dtype (fp8_w8a8: FP8 experts, bf16 activations quantized per token)")
    ap.add_argument("--tokens", type=int, nargs="+", default=list(TUNE_TOKENS))
    ap.add_argument("--max-seconds", type=float, default=200, help="stop starting new token counts after this")
    ap.add_argument("--output-dir", default=str(CONFIG_DIR))
    args = ap.parse_args()
    E, H, inter, top_k = layer_shape(args.model, args.tp, args.expert_parallel)
    fp8 = args.dtype == "fp8_w8a8"
    act = torch.bfloat16 if fp8 else getattr(torch, args.dtype)
    dev = torch.device("cuda")
    os.makedirs(args.output_dir, exist_ok=True)
    name = config_file_name(E, H, inter, FP8_DTYPE if fp8 else act, device_name(dev))
    out_path = os.path.join(args.output_dir, name)
    try:
        table = json.load(open(out_path))
    except FileNotFoundError:
        table = {}
    g = torch.Generator(device=dev).manual_seed(0)
    experts = make_experts(E, H, inter, args.dtype, dev, g)
    t0 = time.time()
    for T in args.tokens:
        if time.time() - t0 > args.max_seconds:
            print(f"time limit: stopping before {T} tokens", flush=True)
            break
        x = torch.randn(T, H, generator=g, device=dev).to(act)
        weights, ids = triton_moe.route(torch.randn(T, E, generator=g, device=dev), top_k, True)
        weights = weights.to(act)
        best, best_ms = None, float("inf")
        for cfg in search_space(T, E, top_k, fp8):
            try:
                ms = time_config(cfg, x, experts, weights, ids)
            except Exception as e:  # out of shared memory / registers: not a candidate here
                print(f"  T={T} {cfg}: {type(e).__name__}", flush=True)
                continue
            if ms < best_ms:
                best, best_ms = cfg, ms
        if best is None:
            print(f"T={T}: no config ran", flush=True)
            continue
        table[str(T)] = {k: best[k] for k in KEYS}
        print(f"T={T}: {best_ms * 1e3:.1f} us with {best} ({time.time() - t0:.0f} s)", flush=True)
        with open(out_path, "w") as f:
            json.dump(dict(sorted(table.items(), key=lambda kv: int(kv[0]))), f, indent=2)
            f.write("\n")
    print(out_path)


if __name__ == "__main__":
    main()
