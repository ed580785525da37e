#!/usr/bin/env python3
"""The W8A8 GEMM: cuBLASLt (torch._scaled_mm, the default) against our Triton kernel
(pagedserve/layers/quant/triton_fp8_gemm.py) at Llama-3.1-8B's four linear shapes, token counts
1 to 4096 (issue 34: "torch's scaled matmul on cuBLASLt, or Triton where it wins: measure it").
The Triton kernel runs the config it would serve with (fp8_gemm_config.get_config: the tuned table
of this GPU and shape when pagedserve/layers/quant/configs/ has one, "config_source" says which),
and each row names what PAGEDSERVE_FP8_GEMM=auto picks there ("auto") and that pick's time.

Each point: microseconds per GEMM, from a CUDA graph of one GEMM per weight copy, with enough
copies (>= 256 MB of fp8 weights) that every launch reads its weight from HBM as a decode step does,
not from L2; per-token activation scales, per-channel weight scales, bf16 output. Also the largest
difference between the two outputs relative to the output's largest value.

Also each kernel's effective bandwidth: the bytes it must move at least (fp8 weight and input,
bf16 output) over its time (an H200 copies at ~4.3 TB/s).

    python benchmarks/kernels/fp8_gemm_ab.py --output $OUT/fp8_gemm_ab.json     # ~2-3 min on an H200
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks" / "kernels"))

from pagedserve.benchmark.results import write_result  # noqa: E402
from pagedserve.layers.quant import fp8_ops  # noqa: E402
from pagedserve.layers.fused_moe.config import device_name  # noqa: E402
from pagedserve.layers.quant.fp8_gemm_config import config_file_name, get_config, load_table, triton_wins  # noqa: E402
from pagedserve.layers.quant.triton_fp8_gemm import triton_fp8_gemm  # noqa: E402

from graph_timing import WEIGHT_BYTES_PER_GRAPH, cold_copies, graph_us_per_copy  # noqa: E402  (benchmarks/kernels/)

# (name, N, K) of Llama-3.1-8B's linears: fused qkv, o, fused gate_up, down.
SHAPES = [("qkv_proj", 6144, 4096), ("o_proj", 4096, 4096), ("gate_up_proj", 28672, 4096),
          ("down_proj", 4096, 14336)]


def cublaslt(xq, xs, wq, ws):
    return torch._scaled_mm(xq, wq.t(), scale_a=xs, scale_b=ws.view(1, -1), out_dtype=torch.bfloat16)


def triton(xq, xs, wq, ws):
    return triton_fp8_gemm(xq, xs, wq, ws, torch.bfloat16)


def us_per_gemm(fn, xq, xs, weights, replays: int) -> float:
    """Median microseconds per GEMM of one graph that runs fn once per weight copy."""
    return graph_us_per_copy(lambda w: fn(xq, xs, *w), weights, replays)


def bench(tokens: list[int], replays: int) -> list[dict]:
    rows = []
    g = torch.Generator(device="cuda").manual_seed(0)
    for name, n, k in SHAPES:
        weights = cold_copies(fp8_ops.quantize_per_channel(0.02 * torch.randn(n, k, device="cuda", generator=g)))
        copies = len(weights)
        for m in tokens:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=g)
            xq, xs = fp8_ops.quantize_per_token(x)
            ref = cublaslt(xq, xs, *weights[0]).float()
            diff = (triton(xq, xs, *weights[0]).float() - ref).abs().max() / ref.abs().max().clamp(min=1e-30)
            dev = xq.device
            row = {"shape": name, "n": n, "k": k, "tokens": m, "weight_copies": copies,
                   "cublaslt_us": round(us_per_gemm(cublaslt, xq, xs, weights, replays), 2),
                   "triton_us": round(us_per_gemm(triton, xq, xs, weights, replays), 2),
                   "max_rel_diff": float(diff), "triton_config": get_config(m, n, k, dev),
                   "config_source": "tuned" if load_table(config_file_name(n, k, device_name(dev))) else "heuristic",
                   "auto": "triton" if triton_wins(m, n, k, dev) else "cublas"}
            row["triton_over_cublaslt"] = round(row["triton_us"] / row["cublaslt_us"], 3)
            row["auto_us"] = row["triton_us"] if row["auto"] == "triton" else row["cublaslt_us"]
            row["auto_over_cublaslt"] = round(row["auto_us"] / row["cublaslt_us"], 3)
            # Bytes a GEMM must move at least (fp8 weight and input, bf16 output) over its time.
            min_bytes = n * k + m * k + 2 * m * n
            row["cublaslt_GBps"] = round(min_bytes / row["cublaslt_us"] / 1e3, 1)
            row["triton_GBps"] = round(min_bytes / row["triton_us"] / 1e3, 1)
            print(row, flush=True)
            rows.append(row)
        del weights
        torch.cuda.empty_cache()
    return rows


def table(doc: dict) -> str:
    lines = ["| shape | tokens | cuBLASLt us | Triton us | Triton / cuBLASLt | cuBLASLt GB/s | Triton GB/s "
             "| Triton config (source) | auto picks |", "|---|---|---|---|---|---|---|---|---|"]
    for r in doc["results"]["gemms"]:
        c = r["triton_config"]
        cfg = f"{c['BLOCK_M']}x{c['BLOCK_N']}x{c['BLOCK_K']} split {c['SPLIT_K']} ({r['config_source']})"
        lines.append(f"| {r['shape']} | {r['tokens']} | {r['cublaslt_us']} | {r['triton_us']} | "
                     f"{r['triton_over_cublaslt']} | {r['cublaslt_GBps']} | {r['triton_GBps']} | {cfg} | {r['auto']} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--output", required=True)
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096])
    ap.add_argument("--replays", type=int, default=20)
    args = ap.parse_args()
    if not torch.cuda.is_available() or not fp8_ops.scaled_mm_supported(torch.device("cuda")):
        sys.exit("fp8_gemm_ab.py needs a CUDA GPU with FP8 (compute capability 8.9+)")
    config = {"model": "llama-3.1-8b shapes", "activation_scales": "per token",
              "weight_scales": "per channel", "out_dtype": "bfloat16",
              "weight_bytes_per_graph": WEIGHT_BYTES_PER_GRAPH}
    write_result(args.output, "fp8_gemm_ab", None, config, {"gemms": bench(args.tokens, args.replays)},
                 table_md=table)


if __name__ == "__main__":
    main()
