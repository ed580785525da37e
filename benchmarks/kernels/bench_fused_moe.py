"""The MoE layer alone, batch 1..512: our Triton path (tuned table or default) against the torch
path on the same shapes, and against vLLM's fused_experts when vLLM imports (--vllm). Routing is
timed apart (ours, torch). Also the bandwidth achieved: the bytes of the experts the batch
touches (counted from its routing) over the time, against the device's copy bandwidth.
--fp8 also times the same experts in FP8 (W8A8: quantized per output channel per expert, the
tokens per token), with its own bytes (1 per weight), and the ratio bf16 time / fp8 time.

    python benchmarks/kernels/bench_fused_moe.py [--models qwen3-30b-a3b mixtral-8x7b] [--vllm] [--fp8] \
        [--batches 1 2 4 ...] [--tp 2 [--expert-parallel]] --output benchmarks/results/h200/moe_layer.json
(--tp 2 times one rank's share: sharded intermediate, or with --expert-parallel whole experts.)
--timing graph (default): ours and vLLM's fused_experts each timed as a decode step runs them, one CUDA
graph of one call per random routing, enough routings that their experts reach 256 MB (so they come
from HBM), replayed (graph_timing.py, as the tuner times); a call that cannot be captured is timed
by do_bench and its row says "launch" (if vLLM's cannot be captured, ours is timed by do_bench too,
`ours_launch_us`, and the ratio is of those). --timing launch: do_bench for both (this file's
figures before 2026-12-02), where each call's host launch cost is in its time. Routing and the
torch path are timed by do_bench.
Needs CUDA.
"""
from __future__ import annotations

import argparse
import sys

import torch
import triton

from graph_timing import copies_for, timed_us
from moe_shapes import MODELS, layer_shape

from pagedserve.benchmark.hardware import measure_copy_bandwidth
from pagedserve.benchmark.roofline import experts_touched
from pagedserve.benchmark.results import git_commit, write_result
from pagedserve.layers.fused_moe import triton_moe
from pagedserve.layers.fused_moe.config import get_config
from pagedserve.layers.fused_moe.reference import fused_experts_torch
from pagedserve.layers.fused_moe.routing import select_experts_torch
from pagedserve.layers.quant.fp8_ops import FP8_DTYPE, quantize_per_channel

BATCHES = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)


def vllm_fused_experts():
    try:
        from vllm.model_executor.layers.fused_moe import fused_experts
        return fused_experts
    except Exception as e:  # not installed here, or an incompatible build
        print(f"vLLM fused_experts unavailable: {e}", file=sys.stderr)
        return None


def vllm_align():
    """vLLM's moe_align_block_size (topk_ids, block_size, num_experts), or None."""
    try:
        from vllm.model_executor.layers.fused_moe.moe_align_block_size import moe_align_block_size
        return moe_align_block_size
    except Exception as e:  # noqa: BLE001  not installed here, or moved in this build
        print(f"vLLM moe_align_block_size unavailable: {e}", file=sys.stderr)
        return None


def fp8_experts(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[E, N, K] -> (fp8 [E, N, K], float32 scales [E, N]), one expert at a time (as the layer does)."""
    q = torch.empty(w.shape, dtype=FP8_DTYPE, device=w.device)
    s = torch.empty(w.shape[:2], dtype=torch.float32, device=w.device)
    for e in range(w.shape[0]):
        q[e], s[e] = quantize_per_channel(w[e])
    return q, s


def call_us(fn, calls: list, timing: str) -> tuple[float, str]:
    """(us per call, "graph" | "launch") of fn over calls (one routing each): --timing's way."""
    return timed_us(fn, calls) if timing == "graph" else timed_us(fn, calls, graph=False, rep_ms=50)


def bench_model(model: str, tp: int, use_vllm: bool, bandwidth: float, expert_parallel: bool = False,
                fp8: bool = False, batches=BATCHES, timing: str = "graph") -> dict:
    """Rank 0's layer. Under expert parallelism it routes over every expert and drops the pairs of
    the other ranks' experts, as FusedMoE does."""
    E, H, inter, top_k = layer_shape(model, tp, expert_parallel)
    E_all = E * tp if expert_parallel else E
    dtype, dev = torch.bfloat16, torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    w13 = torch.randn(E, 2 * inter, H, generator=g, device=dev).mul_(H ** -0.5).to(dtype)
    w2 = torch.randn(E, H, inter, generator=g, device=dev).mul_(inter ** -0.5).to(dtype)
    theirs = vllm_fused_experts() if use_vllm else None
    if fp8:
        (q13, s13), (q2, s2) = fp8_experts(w13), fp8_experts(w2)
    rows = {}
    for T in batches:
        x = torch.randn(T, H, generator=g, device=dev).to(dtype)
        logits = torch.randn(T, E_all, generator=g, device=dev).to(dtype)
        weights, ids = triton_moe.route(logits, top_k, True)
        if expert_parallel:
            ids = torch.where(ids < E, ids, E)  # rank 0 holds experts 0 .. E-1
        w = weights.to(dtype)
        touched = int(torch.unique(ids[ids < E]).numel())
        expert_bytes = touched * 3 * H * inter * 2
        # (x, weights in the activation dtype, the router's weights, ids) per call: the first is this
        # row's routing, the others fresh ones, until the experts they touch reach graph_timing's 256 MB.
        calls = [(x, w, weights, ids)]
        for _ in range(copies_for(expert_bytes) - 1 if timing == "graph" else 0):
            xc = torch.randn(T, H, generator=g, device=dev).to(dtype)
            wc, ic = triton_moe.route(torch.randn(T, E_all, generator=g, device=dev).to(dtype), top_k, True)
            calls.append((xc, wc.to(dtype), wc, torch.where(ic < E, ic, E) if expert_parallel else ic))
        ours_us, ours_timing = call_us(lambda c: triton_moe.fused_experts(c[0], w13, w2, c[1], c[3],
                                                                          may_drop=expert_parallel), calls, timing)
        ours = ours_us / 1e3  # ms, as do_bench gave it
        row = {"ours_us": round(ours_us, 1), "ours_timing": ours_timing, "routings_timed": len(calls),
               "experts_touched": touched,
               # the roofline's expectation under uniform routing, beside the count of this routing
               "experts_touched_expected": round(experts_touched(T, E_all, top_k) * E / E_all, 1),
               "ours_bandwidth_fraction": round(expert_bytes / (ours * 1e-3) / bandwidth, 3),
               "config": get_config(T, E, H, inter, top_k, dtype, dev),
               "routing_ours_us": round(1e3 * triton.testing.do_bench(
                   lambda: triton_moe.route(logits, top_k, True), warmup=10, rep=50), 1),
               "routing_torch_us": round(1e3 * triton.testing.do_bench(
                   lambda: select_experts_torch(logits, top_k, True), warmup=10, rep=50), 1)}
        # The sort/pad alone at this row's block size (the part of the layer that is not a GEMM, and
        # grows fastest with the batch in the one-program align), and vLLM's where it imports.
        block_m = row["config"]["BLOCK_M"]
        row["align_us"] = round(call_us(lambda c: triton_moe._align(c[3], E, block_m), calls, timing)[0], 1)
        if theirs is not None and not expert_parallel and (align := vllm_align()) is not None:
            try:
                row["vllm_align_us"] = round(call_us(lambda c: align(c[3], block_m, E), calls, timing)[0], 1)
            except Exception as e:  # noqa: BLE001  (its signature moved): the layer's figures stand without it
                print(f"vLLM align not timed: {type(e).__name__}: {str(e)[:120]}", flush=True)
        if fp8:
            scales = dict(w13_scale=s13, w2_scale=s2)
            f8_us, f8_timing = call_us(lambda c: triton_moe.fused_experts(c[0], q13, q2, c[1], c[3],
                                                                         may_drop=expert_parallel, **scales),
                                       calls, timing)
            f8 = f8_us / 1e3
            row.update(fp8_us=round(f8_us, 1), fp8_timing=f8_timing,
                       fp8_bandwidth_fraction=round(expert_bytes / 2 / (f8 * 1e-3) / bandwidth, 3),
                       fp8_config=get_config(T, E, H, inter, top_k, FP8_DTYPE, dev))
            if f8_timing == ours_timing:
                row["fp8_speedup_over_bf16"] = round(ours / f8, 3)
        if T <= 64:  # the per-expert loop is slow and syncs; enough to show the gap
            row["torch_us"] = round(1e3 * triton.testing.do_bench(
                lambda: fused_experts_torch(x, w13, w2, w, ids), warmup=3, rep=20), 1)
        if theirs is not None and not expert_parallel:
            # vLLM's layout: w1 [E, 2I, H] gate then up (as ours), w2 [E, H, I]; int32 ids are fine.
            vl_us, vl_timing = call_us(lambda c: theirs(c[0], w13, w2, c[2], c[3]), calls, timing)
            row.update(vllm_us=round(vl_us, 1), vllm_timing=vl_timing)
            if vl_timing != ours_timing:  # one side could not be captured: both as they launch, then
                if ours_timing == "graph":
                    ours_us, _ = call_us(lambda c: triton_moe.fused_experts(c[0], w13, w2, c[1], c[3]), calls, "launch")
                    row["ours_launch_us"] = round(ours_us, 1)
                else:
                    vl_us, _ = call_us(lambda c: theirs(c[0], w13, w2, c[2], c[3]), calls, "launch")
                    row["vllm_launch_us"] = round(vl_us, 1)
            row["ours_over_vllm_speed"] = round(vl_us / ours_us, 3)
        rows[str(T)] = row
        print(model, T, row, flush=True)
    return {"shape": {"experts_per_rank": E, "hidden": H, "intermediate_per_rank": inter, "top_k": top_k, "tp": tp,
                      "expert_parallel": expert_parallel},
            "batches": rows}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", nargs="+", default=list(MODELS))
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--expert-parallel", action="store_true", help="the per-rank shape of whole experts per rank")
    ap.add_argument("--vllm", action="store_true", help="also time vLLM's fused_experts (vLLM on PYTHONPATH)")
    ap.add_argument("--fp8", action="store_true", help="also time FP8 (W8A8) experts beside bf16")
    ap.add_argument("--batches", type=int, nargs="+", default=list(BATCHES))
    ap.add_argument("--timing", choices=["graph", "launch"], default="graph",
                    help="graph: CUDA graph replays over several routings (what decode pays); launch: do_bench")
    ap.add_argument("--output", default=None)
    args = ap.parse_args()
    if args.output:
        git_commit()
    bw = measure_copy_bandwidth()
    results = {m: bench_model(m, args.tp, args.vllm, bw, args.expert_parallel, args.fp8, args.batches, args.timing)
               for m in args.models}
    results["copy_bandwidth_GBps"] = round(bw / 1e9, 1)
    ratios = {f"{m}_layer_b{T}_over_vllm": row["ours_over_vllm_speed"]
              for m in args.models for T, row in results[m]["batches"].items() if "ours_over_vllm_speed" in row}
    ratios.update({f"{m}_layer_b{T}_fp8_over_bf16": row["fp8_speedup_over_bf16"]
                   for m in args.models for T, row in results[m]["batches"].items() if "fp8_speedup_over_bf16" in row})
    if args.output:
        write_result(args.output, "moe_layer", None, {"models": args.models, "tp": args.tp, "dtype": "bfloat16",
                                                      "fp8": args.fp8, "expert_parallel": args.expert_parallel, "timing": args.timing,
                                                      "batches": list(args.batches)}, results, {}, ratios)


if __name__ == "__main__":
    main()
