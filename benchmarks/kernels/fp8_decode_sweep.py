"""The FP8 (e4m3) KV decode kernel's launch on the GPU: BLOCK_N x warps x stages x the tile cast
(to q's dtype, bf16, or f16: the dots in fp16) at batch x context (64, 4096), (256, 1024),
(16, 8192), (1, 32768), Llama-3.1-8B attention (32 q heads, 8 KV heads, head_dim 128, block
size 16), beside the bf16 kernel at its default launch on the same shapes.

Each time is triton.testing.do_bench's median (L2 flushed) of paged_decode as an eager decode
step runs it (the default split plan, programs longest first); bandwidth is the bytes a decode
must read (K/V, q, the output, the block tables; bench_paged_decode.decode_bytes) over that time,
as a fraction of the measured device copy bandwidth. Every variant's output is checked against
reference.py over the same e4m3 pools (dequantized with their scales) within TOLERANCE; a variant
outside it is never "best". Variants are named as DECODE_FP8_LAUNCH takes them, so the best one's
name is the flip. A time budget (--budget-s) keeps the run under 3 minutes on an H200: what it
did not reach is listed, not guessed.

    python benchmarks/kernels/fp8_decode_sweep.py --output $OUT/fp8_decode_sweep.json
"""
from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

import torch
import triton

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks" / "kernels"))

from bench_paged_decode import copy_bandwidth, decode_bytes, make_paged  # noqa: E402
from pagedserve.attention import decode_plan, reference, triton_ops  # noqa: E402
from pagedserve.attention.kv_quant import calibration_scale, quantize_kv  # noqa: E402
from pagedserve.attention.metadata import AttentionMetadata  # noqa: E402
from pagedserve.benchmark.results import git_commit, write_result  # noqa: E402

H, HKV, D, BLOCK_SIZE = 32, 8, 128, 16
SHAPES = [(64, 4096), (256, 1024), (16, 8192), (1, 32768)]
# bf16 outputs of half-precision dots over e4m3 tiles, fp32 softmax: the FP8 GPU tests' tolerance.
TOLERANCE = dict(rtol=2e-2, atol=2e-2)
# Seconds kept for each shape after the first: its variants are compiled by then.
RESERVE_S = 12.0


def variants() -> list[str]:
    """Today's fp8 launch first (the bf16 one: DECODE_FP8_LAUNCH ""), then BLOCK_N 256 (a tile of
    the bf16 launch's bytes), then the rest; each with both casts."""
    names = []
    for block_n in (128, 256, 64):
        for warps in (4, 8):
            for stages in (3, 2, 4):
                if block_n == 64 and (warps, stages) != (4, 3):
                    continue  # half the bf16 tile's bytes again: one point says whether smaller helps
                if block_n == 256 and stages == 4:
                    continue  # 4 stages of 256-position e4m3 K and V tiles: 256 KB, past an SM's shared memory
                for cast in ("", "+f16"):
                    names.append(f"bn{block_n}+w{warps}+s{stages}{cast}")
    return names


def bench(fn) -> float:
    return triton.testing.do_bench(fn, warmup=10, rep=60, return_mode="median")


def decode_meta(batch: int, context: int, seq_lens: torch.Tensor, tables: torch.Tensor) -> AttentionMetadata:
    dev = seq_lens.device
    return AttentionMetadata(
        slot_mapping=torch.full((batch,), -1, dtype=torch.long, device=dev),
        query_start_loc=torch.arange(batch + 1, dtype=torch.int32, device=dev), seq_lens=seq_lens,
        block_tables=tables, num_decodes=batch, max_query_len=1, max_seq_len=context, block_size=BLOCK_SIZE,
        query_lens_cpu=[1] * batch, seq_lens_cpu=[context] * batch)


def fp8_bytes(batch: int, context: int) -> int:
    """decode_bytes with 1-byte K/V and q / the output still bf16."""
    return decode_bytes(batch, context, H, HKV, D, BLOCK_SIZE, 1) + 2 * batch * H * D * (2 - 1)


def sweep_shape(batch: int, context: int, names: list[str], copy_gbps: float | None, deadline: float) -> dict:
    q, kc16, vc16, tables, seq_lens = make_paged(batch, context, H, HKV, D, BLOCK_SIZE, torch.bfloat16)
    ks, vs = calibration_scale(kc16.abs().amax()), calibration_scale(vc16.abs().amax())
    kc, vc = quantize_kv(kc16, ks), quantize_kv(vc16, vs)
    scale = D ** -0.5
    order = triton_ops.longest_first(seq_lens)
    out = torch.empty_like(q)
    frac = (lambda gbps: gbps / copy_gbps) if copy_gbps else (lambda gbps: None)  # noqa: E731

    bf16_ms = bench(lambda: triton_ops.paged_decode(q, kc16, vc16, seq_lens, tables, context, scale, out,
                                                    order=order))
    bf16_gbps = decode_bytes(batch, context, H, HKV, D, BLOCK_SIZE, 2) / bf16_ms / 1e6
    row = {"batch": batch, "context": context, "bf16_default": {"ms": bf16_ms, "GBps": bf16_gbps,
                                                                "bandwidth_fraction": frac(bf16_gbps)},
           "fp8": {}, "not_reached": []}
    del kc16, vc16
    ref = reference.paged_attention(q, kc, vc, decode_meta(batch, context, seq_lens, tables), scale,
                                    k_scale=ks, v_scale=vs).float()
    nbytes = fp8_bytes(batch, context)
    for name in names:
        if time.monotonic() > deadline:
            row["not_reached"].append(name)
            continue
        launch = decode_plan.parse_decode_launch(name, fp8=True)
        kw = dict(block_n=launch.block_n, num_warps=launch.num_warps, num_stages=launch.num_stages,
                  f16_dot=launch.f16_dot, order=order, k_scale=ks, v_scale=vs)
        try:
            out.zero_()
            triton_ops.paged_decode(q, kc, vc, seq_lens, tables, context, scale, out, **kw)
            err = (out.float() - ref).abs()
            ok = bool(torch.allclose(out.float(), ref, **TOLERANCE))
            ms = bench(lambda: triton_ops.paged_decode(q, kc, vc, seq_lens, tables, context, scale, out, **kw))
        except Exception as e:  # a launch the GPU cannot take (shared memory): say so, go on
            row["fp8"][name] = {"error": repr(e)[:300]}
            print(f"  {name}: {row['fp8'][name]['error']}", flush=True)
            continue
        gbps = nbytes / ms / 1e6
        row["fp8"][name] = {"ms": ms, "GBps": gbps, "bandwidth_fraction": frac(gbps),
                            "over_bf16": ms / bf16_ms, "max_abs_err": err.max().item(), "within_tolerance": ok}
        print(f"  {name:22s} {ms * 1e3:8.1f} us  {gbps:7.0f} GB/s  x{ms / bf16_ms:.3f} of bf16  "
              f"err {err.max().item():.2e}{'' if ok else '  OUT OF TOLERANCE'}", flush=True)
    ok = {n: r for n, r in row["fp8"].items() if r.get("within_tolerance")}
    if ok:
        best = min(ok, key=lambda n: ok[n]["ms"])
        row["best"] = dict(ok[best], launch=best)
        base = decode_plan.DecodeLaunch()
        today = f"bn{base.block_n}+w{base.num_warps}+s{base.num_stages}"
        if today in ok:
            row["best_over_today"] = ok[best]["ms"] / ok[today]["ms"]
    del q, kc, vc, tables, out, ref
    torch.cuda.empty_cache()
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--output", default=str(ROOT / "benchmarks/results/h200/fp8_parts/fp8_decode_sweep.json"))
    ap.add_argument("--budget-s", type=float, default=135.0,
                    help="stop starting variants after this many seconds (RESERVE_S kept for each later shape)")
    ap.add_argument("--shapes", default=None, help="e.g. 64x4096,1x32768 (default: the four above)")
    args = ap.parse_args()
    git_commit()  # refuse before measuring, not after
    shapes = SHAPES if not args.shapes else [tuple(int(x) for x in s.split("x")) for s in args.shapes.split(",")]
    names = variants()
    dev = torch.cuda.get_device_name()
    t0 = time.monotonic()
    copy = copy_bandwidth()
    copy_gbps = copy["GBps"] if copy else None
    print(f"device {dev}; copy {copy_gbps and round(copy_gbps)} GB/s; {len(names)} fp8 variants", flush=True)
    config = {"shapes": [list(s) for s in shapes], "num_heads": H, "num_kv_heads": HKV, "head_dim": D,
              "block_size": BLOCK_SIZE, "query_dtype": "bfloat16", "kv_scales": "per tensor, calibration_scale(amax)",
              "variants": names, "tolerance_vs_reference": TOLERANCE, "budget_s": args.budget_s,
              "split_tokens": decode_plan.decode_split_tokens(), "order": "longest first",
              "bf16_launch": dataclasses.asdict(decode_plan.decode_launch_settings()),
              "fp8_launch_today": dataclasses.asdict(decode_plan.fp8_decode_launch_settings()),
              "timing": "triton.testing.do_bench median (L2 flushed), eager paged_decode", "triton": triton.__version__,
              "torch": torch.__version__}
    results, ratios = {}, {}
    out_path = Path(args.output)
    for i, (batch, context) in enumerate(shapes):
        # The first shape compiles every variant (~1-3 s each); the later ones reuse those kernels and
        # need about RESERVE_S each, which is kept for them.
        deadline = t0 + args.budget_s - RESERVE_S * (len(shapes) - 1 - i)
        print(f"batch {batch} x context {context}", flush=True)
        row = sweep_shape(batch, context, names, copy_gbps, max(deadline, time.monotonic() + 5))
        key = f"{batch}x{context}"
        results[key] = row
        if "best" in row:
            ratios[f"{key}_best_fp8_over_bf16"] = row["best"]["over_bf16"]
            if "best_over_today" in row:
                ratios[f"{key}_best_over_today_fp8"] = row["best_over_today"]
        write_result(out_path, "fp8_decode_sweep", None, config, results, {"device_copy": copy} if copy else {},
                     ratios, markdown, device=dev)
    print(f"\nbest fp8 launch per shape (DECODE_FP8_LAUNCH names), {time.monotonic() - t0:.0f} s:")
    for key, row in results.items():
        b = row.get("best")
        bf = row["bf16_default"]
        print(f"  {key:10s} bf16 {bf['ms'] * 1e3:7.1f} us ({_pct(bf['bandwidth_fraction'])})  " +
              (f"fp8 best {b['launch']:22s} {b['ms'] * 1e3:7.1f} us ({_pct(b['bandwidth_fraction'])}, "
               f"x{b['over_bf16']:.3f} of bf16)" if b else "fp8: no variant within tolerance") +
              (f"; not reached: {len(row['not_reached'])}" if row["not_reached"] else ""))
    print(f"wrote {out_path}", flush=True)
    return 0


def _pct(x) -> str:
    return "–" if x is None else f"{100 * x:.1f}% of copy"


def markdown(rec: dict) -> str:
    lines = [f"# FP8 KV decode launch sweep — {rec['device']}", "",
             f"Llama-3.1-8B attention, block size 16, bf16 queries; commit `{rec['commit'][:10]}`, {rec['date']}; "
             f"`{rec['command']}`", "",
             "| batch x context | bf16 default us | bf16 % copy | fp8 today us | fp8 best | us | % copy "
             "| best / bf16 |",
             "|---|---|---|---|---|---|---|---|"]
    base = decode_plan.DecodeLaunch()
    today = f"bn{base.block_n}+w{base.num_warps}+s{base.num_stages}"
    for key, row in rec["results"].items():
        bf, b, t = row["bf16_default"], row.get("best", {}), row["fp8"].get(today, {})
        us = lambda r: f"{r['ms'] * 1e3:.1f}" if r.get("ms") else "–"  # noqa: E731
        pc = lambda r: f"{100 * r['bandwidth_fraction']:.1f}" if r.get("bandwidth_fraction") else "–"  # noqa: E731
        head = f"| {key} | {us(bf)} | {pc(bf)} | {us(t)} | "
        lines.append(head + (f"{b['launch']} | {us(b)} | {pc(b)} | {b['over_bf16']:.3f} |" if b else "– | – | – | – |"))
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
