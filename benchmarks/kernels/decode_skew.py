"""Paged decode attention as a decode graph launches it, on serving's uneven contexts and on even ones.

Why: a decode CUDA graph fixes each sequence's split count by the batch size (at 64 sequences,
one), so in a serving batch the longest context's one program can outlast everyone else's. This
times the kernel pair (decode + split reduction) the way a captured graph runs it (max_seq_len =
max_model_len, 4096) for Llama-3.1-8B's attention (32 query heads, 8 KV heads, head_dim 128,
bf16, 16-token blocks) at each --num-seqs, for each --split-tokens (0: the split count alone;
N: length-aware splits of about N positions; "balanced", or "balanced@R" with an even share over R
programs instead of the device's default: see triton_decode's balanced plan; "slots": the balanced
cut in the slots' grid; "auto": slots, balanced or 0 as decode_plan.pick_split_mode picks for the
lengths, as a decode graph's replay does), over two sets of
contexts:
  serving  contexts of running sharegpt-like requests (max 2048 tokens): a request drawn with
           probability proportional to its output length, at a uniform point of its output
  even     every context the serving set's mean, so the same number of positions in all
  long     with --long L: the serving set with its first context replaced by L (one long request
           decoding beside short ones, as in long_context.py's mix; --max-model-len >= L)
Each case is 32 launches (one per layer) captured in a CUDA graph, replayed --replays times;
microseconds per launch. Needs CUDA.

  python benchmarks/kernels/decode_skew.py --output benchmarks/results/h200/decode_skew.json
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

from pagedserve.attention import decode_plan, triton_ops  # noqa: E402
from pagedserve.benchmark.results import write_result  # noqa: E402
from pagedserve.workloads import make_workload  # noqa: E402

from graph_timing import graph_us_per_launch  # noqa: E402  (benchmarks/kernels/)

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 32, 8, 128, 16


def serving_contexts(n: int, seed: int) -> list[int]:
    reqs = make_workload("sharegpt-like", 4000, seed=seed)
    rng = random.Random(seed)
    picked = rng.choices(reqs, weights=[r.output_len for r in reqs], k=n)
    return [len(r.prompt_token_ids) + rng.randrange(r.output_len) + 1 for r in picked]


def split_mode(text: str) -> tuple[int, int | None]:
    """--split-tokens value -> (split_tokens for paged_decode, programs of the even share or None); "auto"
    -> (None, None)."""
    if text == "auto":
        return None, None
    if text == "slots":
        return decode_plan.SLOTS, None
    if text.startswith("balanced"):
        share = text.partition("@")[2]
        return decode_plan.BALANCED, (int(share) if share else None)
    return int(text), None


def time_case(lens: list[int], mode: str, max_len: int, replays: int, pool) -> float:
    split_tokens, share = split_mode(mode)
    k_cache, v_cache = pool
    if mode == "auto":
        split_tokens = decode_plan.pick_split_mode(lens, len(lens), KV_HEADS, max_len, k_cache.device)
    n = len(lens)
    dev = k_cache.device
    blocks_per_seq = -(-max_len // BLOCK)
    perm = torch.randperm(k_cache.shape[0], device=dev)[: n * blocks_per_seq]
    tables = perm.view(n, blocks_per_seq).to(torch.int32)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=dev)
    q = torch.randn(n, HEADS, HEAD_DIM, dtype=torch.bfloat16, device=dev)
    out = torch.empty_like(q)
    base = decode_plan.choose_num_splits(n, KV_HEADS, max_len, dev)

    def launch():
        triton_ops.paged_decode(q, k_cache, v_cache, seq_lens, tables, max_len, HEAD_DIM ** -0.5, out,
                                num_splits=base, split_tokens=split_tokens, share_programs=share)
    return round(graph_us_per_launch(launch, replays), 2)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-seqs", type=int, nargs="+", default=[16, 32, 64, 96])
    ap.add_argument("--split-tokens", nargs="+", default=["0", "1024", "balanced", "auto"])
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--replays", type=int, default=20)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--long", type=int, default=None,
                    help="also time the serving set with its first context this long (the 'long' set)")
    ap.add_argument("--output", default=None)
    args = ap.parse_args()
    if args.long and args.long > args.max_model_len:
        sys.exit(f"--long {args.long} is past --max-model-len {args.max_model_len}")
    for mode in args.split_tokens:
        split_mode(mode)  # a bad value fails here, before any GPU work
    if not torch.cuda.is_available():
        sys.exit("decode_skew.py needs CUDA")
    torch.manual_seed(args.seed)
    num_blocks = max(args.num_seqs) * -(-args.max_model_len // BLOCK)
    pool = tuple(torch.randn(num_blocks, BLOCK, KV_HEADS, HEAD_DIM, dtype=torch.bfloat16, device="cuda")
                 for _ in range(2))
    results: dict = {}
    for n in args.num_seqs:
        serving = serving_contexts(n, args.seed + n)
        even = [round(statistics.fmean(serving))] * n
        row = {"contexts": {"mean": round(statistics.fmean(serving), 1), "max": max(serving)}}
        sets = [("serving", serving), ("even", even)] + ([("long", [args.long] + serving[1:])] if args.long else [])
        for name, lens in sets:
            row[name] = {t: time_case(lens, t, args.max_model_len, args.replays, pool)
                         for t in args.split_tokens}
            if "auto" in args.split_tokens:
                row[name]["auto_picked"] = decode_plan.pick_split_mode(lens, n, KV_HEADS, args.max_model_len,
                                                                      pool[0].device)
        results[f"n{n}"] = row
        print(n, row, flush=True)
    ratios = {}  # each split size against the switch off, where both ran
    if "0" in args.split_tokens:
        for k, row in results.items():
            for name in ("serving", "even", "long"):
                if name not in row:
                    continue
                for t in args.split_tokens:
                    if t != "0":
                        ratios[f"{k}_{name}_split{t}_over_off"] = round(row[name][t] / row[name]["0"], 3)
    if args.output:
        write_result(args.output, "decode_skew", None,
                     {k: getattr(args, k) for k in ("num_seqs", "split_tokens", "max_model_len", "replays", "seed",
                                                    "long")} |
                     {"attention": "32 q heads, 8 KV heads, head_dim 128, bf16, block 16", "unit": "us per launch"},
                     results, {}, ratios)
    print(ratios)


if __name__ == "__main__":
    main()
