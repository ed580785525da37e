"""FP8 activation quantization fused into the op before the GEMM, against a separate quantize kernel.

Two sections, both on CUDA:
  kernels  at Llama-3.1-8B sizes (hidden 4096, intermediate 14336), bf16, per token count M:
           RMSNorm with the residual add then the per-token quant kernel (two launches) against
           fused_add_rms_norm_fp8 (one), and SiLU-and-mul then the quant kernel against
           silu_and_mul_fp8. Microseconds per op pair, 32 launches captured in one CUDA graph and
           replayed (graph_timing.graph_us_per_launch), and whether the fused outputs (fp8 bytes,
           scales, residual) are bit-equal to the separate pair's.
  decode   one decode step of Llama-3.1-8B (benchmarks/models/llama-3.1-8b, dummy weights,
           --quantization fp8 over bf16, bf16 KV) at each --batches size, every sequence at
           --context tokens, replayed as the engine's decode CUDA graph (runner/cuda_graph.py)
           with the fusion on and off (layers/quant/fusion.py; the model is loaded once and
           re-captured), median ms per step, and the greedy tokens of both (equal when the
           fused kernels are bit-equal to the separate ones).

  python benchmarks/kernels/fp8_fused_quant.py --output $OUT/fp8_fused_quant.json
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks" / "kernels"))

from pagedserve.benchmark.results import write_result  # noqa: E402

from graph_timing import graph_us_per_launch  # noqa: E402  (benchmarks/kernels/)

HIDDEN, INTER = 4096, 14336
MODEL_DIR = ROOT / "benchmarks" / "models" / "llama-3.1-8b"


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype == torch.float8_e4m3fn:
        a, b = a.view(torch.uint8), b.view(torch.uint8)
    return bool(torch.equal(a, b))


def bench_kernels(tokens: list[int], replays: int) -> list[dict]:
    from pagedserve.layers import triton_fused as ops
    from pagedserve.layers.quant.triton_fp8 import quantize_per_token
    rows = []
    for m in tokens:
        g = torch.Generator(device="cuda").manual_seed(m)
        x = torch.randn(m, HIDDEN, device="cuda", dtype=torch.bfloat16, generator=g)
        res = torch.randn(m, HIDDEN, device="cuda", dtype=torch.bfloat16, generator=g)
        w = 1 + 0.1 * torch.randn(HIDDEN, device="cuda", dtype=torch.bfloat16, generator=g)
        gate_up = 2 * torch.randn(m, 2 * INTER, device="cuda", dtype=torch.bfloat16, generator=g)

        def norm_separate():
            y, s = ops.fused_add_rms_norm(x, res, w, 1e-5)
            return (*quantize_per_token(y), s)

        def silu_separate():
            return quantize_per_token(ops.silu_and_mul(gate_up))

        def norm_fused():
            return ops.fused_add_rms_norm_fp8(x, res, w, 1e-5)

        def silu_fused():
            return ops.silu_and_mul_fp8(gate_up)

        row = {"tokens": m}
        for name, sep, fused in (("add_rms_norm", norm_separate, norm_fused), ("silu_and_mul", silu_separate,
                                                                               silu_fused)):
            row[f"{name}_bit_equal"] = all(_bits_equal(a, b) for a, b in zip(sep(), fused()))
            row[f"{name}_separate_us"] = round(graph_us_per_launch(sep, replays), 2)
            row[f"{name}_fused_us"] = round(graph_us_per_launch(fused, replays), 2)
            row[f"{name}_speedup"] = round(row[f"{name}_separate_us"] / row[f"{name}_fused_us"], 3)
        print(row, flush=True)
        rows.append(row)
    return rows


def _decode_meta(batch: int, context: int, block_size: int, device: str = "cuda"):
    """A decode step of `batch` sequences at `context` tokens each, in shuffled physical blocks
    (block 0 left to the graph's padding rows)."""
    from pagedserve.attention.metadata import AttentionMetadata
    per_seq = -(-context // block_size)
    g = torch.Generator().manual_seed(batch)
    tables = (torch.randperm(batch * per_seq, generator=g) + 1).to(torch.int32).view(batch, per_seq).to(device)
    pos = context - 1
    slots = tables[:, pos // block_size].long() * block_size + pos % block_size
    i32 = dict(dtype=torch.int32, device=device)
    meta = AttentionMetadata(slot_mapping=slots, query_start_loc=torch.arange(batch + 1, **i32),
                             seq_lens=torch.full((batch,), context, **i32), block_tables=tables, num_decodes=batch,
                             max_query_len=1, max_seq_len=context, block_size=block_size,
                             query_lens_cpu=[1] * batch, seq_lens_cpu=[context] * batch)
    return meta, batch * per_seq + 1


def bench_decode(batches: list[int], context: int, replays: int) -> list[dict]:
    from pagedserve.layers.quant import get_quantization_config
    from pagedserve.layers.quant.fusion import fuse_activation_quant
    from pagedserve.models.loader import get_model, load_hf_config
    from pagedserve.runner.cuda_graph import DecodeCUDAGraphs
    hf = load_hf_config(MODEL_DIR)
    model = get_model(hf, model_dir=None, device="cuda", dtype=torch.bfloat16, load_format="dummy",
                      quant_config=get_quantization_config("fp8", hf))
    head_dim = hf.hidden_size // hf.num_attention_heads
    block_size, max_len = 16, max(context, 1024)
    rows = []
    for batch in batches:
        meta, num_blocks = _decode_meta(batch, context, block_size)
        caches = [(torch.randn(num_blocks, block_size, hf.num_key_value_heads, head_dim, device="cuda",
                               dtype=torch.bfloat16) * 0.5,
                   torch.randn(num_blocks, block_size, hf.num_key_value_heads, head_dim, device="cuda",
                               dtype=torch.bfloat16)) for _ in range(hf.num_hidden_layers)]
        ids = torch.randint(0, hf.vocab_size, (batch,), device="cuda", generator=torch.Generator("cuda").manual_seed(1))
        positions = torch.full((batch,), context - 1, dtype=torch.long, device="cuda")
        row = {"batch": batch, "context": context}
        tokens = {}
        for mode, on in (("fused", True), ("separate", False)):
            row[f"{mode}_ops"] = fuse_activation_quant(model, on)
            graphs = DecodeCUDAGraphs(model, caches, [batch], max_len, block_size, torch.device("cuda"),
                                      hf.num_key_value_heads)
            graphs.capture()
            times = []
            with torch.inference_mode():
                for i in range(replays + 3):
                    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    a.record()
                    hidden = graphs.run(ids, positions, meta)
                    b.record()
                    torch.cuda.synchronize()
                    if i >= 3:
                        times.append(a.elapsed_time(b))
                tokens[mode] = model.compute_logits(hidden).argmax(-1)
            row[f"{mode}_ms"] = round(statistics.median(times), 4)
            del graphs
            torch.cuda.empty_cache()
        row["speedup"] = round(row["separate_ms"] / row["fused_ms"], 4)
        row["greedy_tokens_equal"] = bool(torch.equal(tokens["fused"], tokens["separate"]))
        print(row, flush=True)
        rows.append(row)
        del caches
        torch.cuda.empty_cache()
    fuse_activation_quant(model)
    return rows


def table(doc: dict) -> str:
    r = doc["results"]
    lines = ["| tokens | norm+quant separate us | fused us | speedup | silu+quant separate us | fused us | speedup | bit-equal |",
             "|---|---|---|---|---|---|---|---|"]
    for k in r.get("kernels", []):
        lines.append(f"| {k['tokens']} | {k['add_rms_norm_separate_us']} | {k['add_rms_norm_fused_us']} | "
                     f"{k['add_rms_norm_speedup']} | {k['silu_and_mul_separate_us']} | {k['silu_and_mul_fused_us']} | "
                     f"{k['silu_and_mul_speedup']} | {k['add_rms_norm_bit_equal'] and k['silu_and_mul_bit_equal']} |")
    lines += ["", "| decode batch | context | separate ms | fused ms | speedup | greedy equal |", "|---|---|---|---|---|---|"]
    for d in r.get("decode", []):
        lines.append(f"| {d['batch']} | {d['context']} | {d['separate_ms']} | {d['fused_ms']} | {d['speedup']} | "
                     f"{d['greedy_tokens_equal']} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--output", required=True)
    ap.add_argument("--sections", nargs="+", default=["kernels", "decode"], choices=["kernels", "decode"])
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 16, 64, 128, 256, 1024, 4096])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 32, 128, 256])
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--replays", type=int, default=30)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("fp8_fused_quant.py needs CUDA")
    results = {}
    if "kernels" in args.sections:
        results["kernels"] = bench_kernels(args.tokens, args.replays)
    if "decode" in args.sections:
        results["decode"] = bench_decode(args.batches, args.context, args.replays)
    config = {"model": "llama-3.1-8b (dummy weights)", "dtype": "bfloat16", "quantization": "fp8",
              "kv_cache_dtype": "auto", "hidden": HIDDEN, "intermediate": INTER, "context": args.context}
    write_result(args.output, "fp8_fused_quant", None, config, results, table_md=table)


if __name__ == "__main__":
    main()
