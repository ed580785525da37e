"""Paged decode attention launch variants, timed as a decode graph runs them, on offline and serving contexts.

Why: in the offline nanovllm run the decode kernel is three quarters of a decode step (Qwen3-0.6B
at 256 sequences, benchmarks/kernels/profile_decode.py), so its bandwidth is the offline throughput.
This times one variant against another on the shapes the benchmarks meet:
  --case NAME:HEADS/KV_HEADS:N  e.g. nanovllm:16/8:256
    nanovllm  contexts of the nanovllm workload's running requests: prompt U(100, 1024) plus a
              uniform point of an output of U(100, 1024)
    serving   running sharegpt-like requests (benchmarks/kernels/decode_skew.py's serving set)
    even      every context the serving set's mean
    fixed256  every context 256 + the same uniform step (fixed256's lockstep decodes)
  --variants  base (the defaults: KV heads the grid's fastest axis, rows taken longest first as
              paged_attention orders them, the order computed outside the timing), and changes to
              it joined with '+': rows (sequences the fastest axis), nolpt (rows in row order),
              bnN, wN, sN (BLOCK_N, warps, stages); e.g. rows+nolpt+bn64, the defaults before 925e530.
Each case is 32 launches in a CUDA graph with max_seq_len = --max-model-len and the split mode a
graph's replay would pick (decode_plan.pick_split_mode), replayed --replays times; microseconds per
launch, and the KV bytes over that time. Needs CUDA.

  python benchmarks/kernels/decode_variants.py --output /tmp/decode_variants.json
"""
from __future__ import annotations

import argparse
import random
import statistics
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks" / "kernels"))

from pagedserve.attention import decode_plan, triton_ops  # noqa: E402
from pagedserve.benchmark.results import write_result  # noqa: E402

from decode_skew import serving_contexts  # noqa: E402  (benchmarks/)
from graph_timing import graph_us_per_launch  # noqa: E402

HEAD_DIM, BLOCK = 128, 16
DEFAULT_CASES = ["nanovllm:16/8:64", "nanovllm:16/8:128", "nanovllm:16/8:256", "serving:32/8:32",
                 "serving:32/8:96", "serving:32/8:256", "even:32/8:256", "fixed256:32/8:1000"]
DEFAULT_VARIANTS = ["base", "nolpt", "rows", "bn64", "s2", "w8", "rows+nolpt+bn64"]


def contexts(kind: str, n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    if kind == "nanovllm":
        return [rng.randint(100, 1024) + rng.randrange(rng.randint(100, 1024)) + 1 for _ in range(n)]
    if kind == "serving":
        return serving_contexts(n, seed)
    if kind == "even":
        return [round(statistics.fmean(serving_contexts(n, seed)))] * n
    if kind == "fixed256":
        return [256 + rng.randint(1, 256)] * n
    raise ValueError(f"--case: unknown contexts {kind!r} (nanovllm, serving, even, fixed256)")


def parse_case(text: str) -> tuple[str, int, int, int]:
    kind, heads, n = text.split(":")
    h, kv = heads.split("/")
    return kind, int(h), int(kv), int(n)


def parse_variant(text: str) -> dict:
    """A variant's paged_decode arguments (decode_plan.parse_decode_launch: the names
    PAGEDSERVE_DECODE_LAUNCH takes), with lpt: whether the rows go longest first."""
    launch = decode_plan.parse_decode_launch(text)
    return {"block_n": launch.block_n, "num_warps": launch.num_warps, "num_stages": launch.num_stages,
            "heads_fastest": launch.heads_fastest, "lpt": launch.longest_first}


def time_case(lens: list[int], heads: int, kv_heads: int, variant: dict, max_len: int, replays: int,
              pool) -> float:
    k_cache, v_cache = pool
    dev = k_cache.device
    n = len(lens)
    variant = dict(variant)
    lpt = variant.pop("lpt", False)
    block_n = variant["block_n"]
    mode = decode_plan.pick_split_mode(lens, n, kv_heads, max_len, dev, block_n=block_n)
    blocks_per_seq = -(-max_len // BLOCK)
    kv = k_cache[:, :, :kv_heads]
    perm = torch.randperm(k_cache.shape[0], device=dev)[: n * blocks_per_seq]
    tables = perm.view(n, blocks_per_seq).to(torch.int32)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=dev)
    order = triton_ops.longest_first(seq_lens) if lpt else None
    q = torch.randn(n, heads, HEAD_DIM, dtype=torch.bfloat16, device=dev)
    out = torch.empty_like(q)
    base = decode_plan.choose_num_splits(n, kv_heads, max_len, dev)

    def launch():
        triton_ops.paged_decode(q, kv, v_cache[:, :, :kv_heads], seq_lens, tables, max_len, HEAD_DIM ** -0.5,
                                out, num_splits=base, split_tokens=mode, order=order, **variant)
    return graph_us_per_launch(launch, replays)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--case", nargs="+", default=DEFAULT_CASES)
    ap.add_argument("--variants", nargs="+", default=DEFAULT_VARIANTS)
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--replays", type=int, default=20)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--output", default=None)
    args = ap.parse_args()
    cases = [parse_case(c) for c in args.case]
    variants = {v: parse_variant(v) for v in args.variants}
    if not torch.cuda.is_available():
        sys.exit("decode_variants.py needs CUDA")
    torch.manual_seed(args.seed)
    # K/V pools with every case's KV heads (sliced per case); the blocks of the largest case.
    num_blocks = max(n for *_, n in cases) * -(-args.max_model_len // BLOCK)
    max_kv = max(kv for _, _, kv, _ in cases)
    pool = tuple(torch.randn(num_blocks, BLOCK, max_kv, HEAD_DIM, dtype=torch.bfloat16, device="cuda")
                 for _ in range(2))
    results: dict = {}
    for text, (kind, heads, kv_heads, n) in zip(args.case, cases):
        lens = contexts(kind, n, args.seed + n)
        kv_bytes = sum(lens) * kv_heads * HEAD_DIM * 2 * 2
        row: dict = {"contexts": {"mean": round(statistics.fmean(lens), 1), "max": max(lens)}, "us": {}, "TBps": {}}
        for name, kw in variants.items():
            us = time_case(lens, heads, kv_heads, kw, args.max_model_len, args.replays, pool)
            row["us"][name] = round(us, 2)
            row["TBps"][name] = round(kv_bytes / us / 1e6, 2)
        results[text] = row
        print(text, row, flush=True)
    ratios = {f"{c}_{v}_over_base": round(r["us"][v] / r["us"]["base"], 3)
              for c, r in results.items() for v in r["us"] if v != "base" and "base" in r["us"]}
    if args.output:
        write_result(args.output, "decode_variants", None,
                     {k: getattr(args, k) for k in ("case", "variants", "max_model_len", "replays", "seed")} |
                     {"attention": "head_dim 128, bf16, block 16", "unit": "us per launch"},
                     results, {}, ratios)
    print(ratios)


if __name__ == "__main__":
    main()
