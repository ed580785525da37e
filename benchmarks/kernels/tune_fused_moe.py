"""Tune the fused MoE grouped GEMM's block sizes on this GPU and write the table the layer reads
(E=..,H=..,I=..,dtype=..,device=...json, into --output-dir: pagedserve/layers/fused_moe/configs/
by default; benchmarks/moe_run.sh writes into $OUT/configs and copies them there).

--dtype bfloat16 (or float16) tunes the bf16 experts; --dtype fp8_w8a8 the FP8 experts (W8A8:
per-token activation scales, per-channel weight scales; the file's key is vLLM's name for it).
For each token count, every config of a pruned search space runs the whole MoE (routing excluded:
activation quantization for fp8, sort/pad, gate/up GEMM, down GEMM, top-k sum) on random routings,
timed as a decode step runs it: one CUDA graph of one call per routing, with enough routings that
the experts they touch reach 256 MB (so each call meets its experts in HBM, as each layer of a step
does), replayed 20 times, median microseconds per call (graph_timing.py). Why graphs: MoE decode
steps replay CUDA graphs, and a call is several launches whose host cost (never paid in a graph)
can be as long as their device time at decode token counts; do_bench (one call at a time from
Python) adds it to every config alike, hiding their differences. The fastest is kept; its entry
records its time ("us") and how it was taken ("timing": "graph", or "launch" where the capture
failed and do_bench timed it; a launch-timed config never beats a graph-timed one). The layer
reads only the block sizes. The file is rewritten after every token count, so a run stopped by
its time limit (--max-seconds, or the caller's timeout) keeps what it finished; rerun with
--tokens for the rest. Needs CUDA.

Sized to finish in about 4 minutes per model and dtype on an H200, where compiling dominates (each
config is two kernel variants, compiled once and reused across token counts): about 30 distinct
configs (search_space), 13 token counts (TUNE_TOKENS; the layer takes the nearest entry, so the
counts in between are served by their neighbours). Measured offline: compiling all 34 fp8 configs
(both variants) for sm_90 took 165 s on a slow shared 2-core CPU; timing added ~15 s with do_bench
(20 ms a config). A graph costs less at decode counts (a few calls of 20-100 us, 20 replays) and
about as much at 4096 tokens (one routing, 20 replays of a 1-4 ms call). --max-seconds (200 in
moe_run.sh) is the backstop.
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

from graph_timing import copies_for, fastest, timed_us
from moe_shapes import MODELS, layer_shape

from pagedserve.layers.fused_moe import triton_moe
from pagedserve.layers.fused_moe.config import CONFIG_DIR, KEYS, config_file_name, device_name
from pagedserve.layers.quant.fp8_ops import FP8_DTYPE, quantize_per_channel
from pagedserve.layers.tuned_tables import write_table

TUNE_TOKENS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)


def search_space(num_tokens: int, num_experts: int, top_k: int, fp8: bool, wide: bool = False) -> list[dict]:
    """Decode-like counts (a few rows per expert): 16-row blocks, no grouping, the widths and depths
    that keep a thin GEMM streaming weights. Beyond: row blocks no taller than twice the rows an
    expert gets on average, grouped by 16, 8 warps on big tiles. fp8 reads K twice as deep per byte.
    wide: the same and the kinds of choice the first cut left out that vLLM's own H200 table makes
    for Mixtral-8x7B (5 stages at 1-8 tokens, BLOCK_K 128 at 64-128, 8 warps on 64 x 128 tiles),
    for a retune of the token counts where the layer trails vLLM's (about twice the configs)."""
    rows_per_expert = num_tokens * top_k / num_experts
    out = []
    if rows_per_expert <= 8:
        depths = (128, 256) if fp8 else (64, 128)
        for n in (32, 64, 128):
            for k in depths:
                for s in (3, 4, 5) if wide else (3, 4):
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
    if wide:
        deeper = [dict(c, BLOCK_K=2 * k) for c in out if c["BLOCK_M"] <= 64 and c["BLOCK_N"] <= 128]
        warps = [dict(c, num_warps=12 - c["num_warps"]) for c in out + deeper
                 if c["BLOCK_M"] * c["BLOCK_N"] == 64 * 128]
        out += deeper + warps
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


def routings(T: int, E: int, H: int, top_k: int, act, expert_bytes: int, g, dev) -> list[tuple]:
    """(x, weights, ids) per call of the timing graph: random inputs and routings, as many as make
    the experts they touch (about min(E, T * top_k) a call) reach graph_timing's 256 MB."""
    out = []
    for _ in range(copies_for(min(E, T * top_k) * expert_bytes)):
        x = torch.randn(T, H, generator=g, device=dev).to(act)
        weights, ids = triton_moe.route(torch.randn(T, E, generator=g, device=dev), top_k, True)
        out.append((x, weights.to(act), ids))
    return out


def time_config(cfg, experts: dict, calls: list[tuple]) -> tuple[float, str]:
    """(us per call, "graph" | "launch") of fused_experts with cfg over `calls` (routings)."""
    w = dict(experts)
    w13, w2 = w.pop("w13"), w.pop("w2")
    return timed_us(lambda c: triton_moe.fused_experts(c[0], w13, w2, c[1], c[2], cfg, **w), calls, rep_ms=20)


def table_entry(cfg: dict, us: float, timing: str) -> dict:
    """A token count's entry: the layer's keys (config.KEYS), then the time and how it was taken."""
    return {**{k: cfg[k] for k in KEYS}, "us": round(us, 2), "timing": timing}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=MODELS[0], help=f"a benchmarks/models name or a config dir ({MODELS})")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--expert-parallel", action="store_true", help="the per-rank shape of whole experts per rank")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "fp8_w8a8"],
                    help="the experts' dtype (fp8_w8a8: FP8 experts, bf16 activations quantized per token)")
    ap.add_argument("--tokens", type=int, nargs="+", default=list(TUNE_TOKENS))
    ap.add_argument("--max-seconds", type=float, default=200, help="stop starting new token counts after this")
    ap.add_argument("--wide", action="store_true", help="search_space's wider set (with --tokens: a targeted retune)")
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
    expert_bytes = sum(t.numel() * t.element_size() for t in experts.values()) // E
    t0 = time.time()
    for T in args.tokens:
        if time.time() - t0 > args.max_seconds:
            print(f"time limit: stopping before {T} tokens", flush=True)
            break
        calls = routings(T, E, H, top_k, act, expert_bytes, g, dev)
        timed = []
        for cfg in search_space(T, E, top_k, fp8, args.wide):
            try:
                timed.append((cfg, *time_config(cfg, experts, calls)))
            except Exception as e:  # out of shared memory / registers: not a candidate here
                print(f"  T={T} {cfg}: {type(e).__name__}", flush=True)
        best = fastest(timed)
        if best is None:
            print(f"T={T}: no config ran", flush=True)
            continue
        table[str(T)] = table_entry(*best)
        print(f"T={T}: {table[str(T)]} ({len(calls)} routings, {time.time() - t0:.0f} s)", flush=True)
        write_table(out_path, table)
    print(out_path)


if __name__ == "__main__":
    main()
