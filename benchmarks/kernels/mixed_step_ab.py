"""A/B of one mixed step (decodes beside a prefill chunk): full graph vs piecewise graphs vs eager.

Why: with cudagraph_mode="piecewise" a step with prefill tokens replays graph pieces with attention
launched eagerly between them (runner/piecewise_graphs.py); with "full" it replays one graph
whose attention is the unified kernel (runner/full_graphs.py). This times the same steps both
ways on one ModelRunner (Llama-3.1-8B's config, dummy weights, bf16, max_model_len 131072): its
full graphs and piecewise graphs are both captured, and each case runs with only
one of the two mixed-step paths left on. Block tables wrap around a pool of --num-blocks blocks
(the K/V read is garbage, the time is not). Per case: the path the runner took, the median and
p90 of --iters steps (CUDA events around execute_model, after 3 warm-up steps), and the largest
difference of the sampled rows' logits between the paths (both in bf16: a sanity check, not a
test). Needs CUDA.

First, the same cases' attention alone (attention_ab: split kernels against the unified kernel,
32 launches in a CUDA graph); --attention-only stops there.

  python benchmarks/kernels/mixed_step_ab.py --output $OUT/mixed_step_ab.json
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from pagedserve.benchmark.results import engine_switches, git_commit  # noqa: E402
from pagedserve.config import EngineConfig  # noqa: E402
from pagedserve.models.loader import load_hf_config  # noqa: E402
from pagedserve.runner.batch import HostBatch  # noqa: E402
from pagedserve.runner.model_runner import ModelRunner  # noqa: E402
from pagedserve.runner.step_input import StepInput  # noqa: E402

# (name, decodes, decode context, chunk tokens, chunk start): serving's mixed steps, short to long.
CASES = [
    ("d64x4k+c512@16k", 64, 4096, 512, 16384),
    ("d128x1k+c256@0", 128, 1024, 256, 0),
    ("d16x8k+c256@100k", 16, 8192, 256, 100_000),
    ("d32x2k+c1024@32k", 32, 2048, 960, 32768),
    ("d8x32k+c2048@64k", 8, 32768, 2048, 65536),
    ("d200x2k+c64@1k", 200, 2048, 64, 1024),
]


def build_runner(args) -> ModelRunner:
    cfg = EngineConfig(model=args.model, load_format="dummy", dtype="bfloat16", device="cuda",
                       max_model_len=args.max_model_len, max_num_seqs=256, max_num_batched_tokens=args.max_tokens,
                       num_gpu_blocks_override=args.num_blocks, swap_space=0, block_size=16)
    runner = ModelRunner(cfg, load_hf_config(args.model), torch.device("cuda", 0), torch.bfloat16)
    runner.load_model()
    runner.allocate_kv_cache(args.num_blocks, 0)
    # No decode graphs: no case is decode-only, and decode rows are off below.
    t1 = time.perf_counter()
    cfg.cudagraph_mode = "full"
    runner.capture_full_graphs()
    t2 = time.perf_counter()
    cfg.cudagraph_mode = "piecewise"
    runner.capture_piecewise_graphs()
    t3 = time.perf_counter()
    runner.profile.update(capture_full_s=t2 - t1, capture_piecewise_s=t3 - t2)
    return runner


def step_input(runner: ModelRunner, decodes: int, ctx: int, chunk: int, start: int) -> StepInput:
    bs, nb = runner.block_size, runner.cache_engine.num_gpu_blocks
    seqs = [(ctx - 1, 1)] * decodes + [(start, chunk)]
    tables = [[(7919 * i + j) % nb for j in range(-(-(s + q) // bs))] for i, (s, q) in enumerate(seqs)]
    total = sum(q for _, q in seqs)
    ids = (np.arange(total, dtype=np.int64) * 7919 + 11) % runner.vocab_size
    batch = HostBatch(ids, np.array([s for s, _ in seqs], dtype=np.int64), np.array([q for _, q in seqs], dtype=np.int64),
                      tables, np.ones(len(seqs), dtype=bool), decodes)
    return StepInput([], [], [], batch)


def time_path(runner: ModelRunner, step: StepInput, iters: int) -> tuple[str, list[float], torch.Tensor]:
    for _ in range(3):
        logits = runner.execute_model(step)
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        logits = runner.execute_model(step)
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return runner.last_graph_path, times, logits.float()


def attention_ab(decodes: int, ctx: int, chunk: int, start: int, replays: int) -> dict:
    """Attention alone at Llama-3.1-8B's shapes (32 heads, 8 KV heads, head_dim 128, bf16, 16-token
    blocks), 32 launches (one per layer) captured in one CUDA graph, replayed `replays` times:
    the split decode + prefill kernels of the eager/piecewise path against the unified kernel of a
    full graph (capacity of a 4096-token, 256-sequence bucket); microseconds per launch, and the
    largest difference of their outputs."""
    from dataclasses import replace

    from pagedserve.attention import triton_ops
    from pagedserve.attention.metadata import AttentionMetadata
    H, Hkv, D, bs = 32, 8, 128, 16
    dev = torch.device("cuda")
    seqs = [(ctx - 1, 1)] * decodes + [(start, chunk)]
    nblocks = [-(-(s + q) // bs) for s, q in seqs]
    perm = torch.randperm(sum(nblocks), device=dev, dtype=torch.int32)
    width = max(nblocks)
    tables = torch.zeros(len(seqs), width, dtype=torch.int32, device=dev)
    off = 0
    for i, n in enumerate(nblocks):
        tables[i, :n] = perm[off:off + n]
        off += n
    kc = torch.randn(sum(nblocks), bs, Hkv, D, device=dev, dtype=torch.bfloat16)
    vc = torch.randn_like(kc)
    T = sum(q for _, q in seqs)
    q = torch.randn(T, H, D, device=dev, dtype=torch.bfloat16)
    qsl = torch.tensor([0] + list(np.cumsum([q_ for _, q_ in seqs])), dtype=torch.int32, device=dev)
    lens = [s + q_ for s, q_ in seqs]
    meta = AttentionMetadata(slot_mapping=torch.full((T,), -1, dtype=torch.long, device=dev), query_start_loc=qsl,
                             seq_lens=torch.tensor(lens, dtype=torch.int32, device=dev), block_tables=tables,
                             num_decodes=decodes, max_query_len=chunk, max_seq_len=max(lens), block_size=bs,
                             query_lens_cpu=[q_ for _, q_ in seqs], seq_lens_cpu=lens)
    cap = triton_ops.unified_capacity(4096, 256, H, Hkv, dev)
    # The graph's metadata has 256 sequences: the step's, then empty ones.
    pad = 256 - len(seqs)
    meta_u = replace(meta, query_start_loc=torch.cat([qsl, qsl[-1:].repeat(pad)]),
                     seq_lens=torch.cat([meta.seq_lens, torch.ones(pad, dtype=torch.int32, device=dev)]),
                     block_tables=torch.cat([tables, torch.zeros(pad, width, dtype=torch.int32, device=dev)]),
                     unified_capacity=cap, seq_lens_cpu=None, query_lens_cpu=None)
    row = {}
    outs = {}
    for name, m in (("split_kernels", meta), ("unified", meta_u)):
        fresh = lambda: replace(m, decode_order=None, unified_work=None)  # noqa: E731
        outs[name] = triton_ops.paged_attention(q, kc, vc, fresh(), D ** -0.5)  # compile, outside the graph
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step_meta = fresh()  # one metadata per step: the first layer builds what the rest reuse
            for _ in range(32):
                triton_ops.paged_attention(q, kc, vc, step_meta, D ** -0.5)
        graph.replay()
        torch.cuda.synchronize()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(replays):
            graph.replay()
        b.record()
        b.synchronize()
        row[f"{name}_us"] = round(1000 * a.elapsed_time(b) / (32 * replays), 1)
        del graph
    row["unified_over_split_kernels"] = round(row["unified_us"] / row["split_kernels_us"], 3)
    row["max_out_diff"] = float((outs["unified"].float() - outs["split_kernels"].float()).abs().max())
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=str(ROOT / "benchmarks/models/llama-3.1-8b"))
    ap.add_argument("--max-model-len", type=int, default=131072)
    ap.add_argument("--max-tokens", type=int, default=4096, help="max_num_batched_tokens (the largest full bucket)")
    ap.add_argument("--num-blocks", type=int, default=16384)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--cases", default=None, help="comma-separated case names (default: all)")
    ap.add_argument("--output", default=None)
    ap.add_argument("--attention-only", action="store_true", help="only the attention A/B (no model)")
    ap.add_argument("--replays", type=int, default=20)
    args = ap.parse_args()
    provenance = {"commit": git_commit(), "command": "python " + " ".join(sys.argv), "switches": engine_switches()}
    wanted = set(args.cases.split(",")) if args.cases else None
    attention = {}
    for name, decodes, ctx, chunk, start in CASES:
        if not wanted or name in wanted:
            attention[name] = attention_ab(decodes, ctx, chunk, start, args.replays)
            print("attention", name, json.dumps(attention[name]), flush=True)
            torch.cuda.empty_cache()
    if args.attention_only:
        if args.output:
            Path(args.output).write_text(json.dumps({"device": torch.cuda.get_device_name(0), **provenance,
                                                     "attention": attention}, indent=1))
        return
    t0 = time.perf_counter()
    runner = build_runner(args)
    runner.short_prefill_graphs = False  # decode rows would take the short chunks: compare the two paths
    full, piecewise = runner.full_graphs, runner.piecewise
    print(f"set up in {time.perf_counter() - t0:.0f} s: {json.dumps(runner.profile)}", flush=True)
    results = {}
    for name, decodes, ctx, chunk, start in CASES:
        if wanted and name not in wanted:
            continue
        step = step_input(runner, decodes, ctx, chunk, start)
        row = {"tokens": decodes + chunk, "decodes": decodes, "decode_context": ctx, "chunk": chunk, "chunk_start": start}
        outs = {}
        for mode, (f, p) in {"full": (full, None), "piecewise": (None, piecewise), "eager": (None, None)}.items():
            runner.full_graphs, runner.piecewise = f, p
            path, times, logits = time_path(runner, step, args.iters)
            outs[mode] = logits
            row[mode] = {"path": path, "ms_p50": round(statistics.median(times), 3),
                         "ms_p90": round(float(np.percentile(times, 90)), 3)}
        runner.full_graphs, runner.piecewise = full, piecewise
        row["full_over_piecewise_p50"] = round(row["full"]["ms_p50"] / row["piecewise"]["ms_p50"], 3)
        row["full_over_eager_p50"] = round(row["full"]["ms_p50"] / row["eager"]["ms_p50"], 3)
        row["max_logit_diff_full_vs_eager"] = float((outs["full"] - outs["eager"]).abs().max())
        results[name] = row
        print(name, json.dumps(row), flush=True)
    out = {"device": torch.cuda.get_device_name(0), **provenance, "model": args.model, "max_model_len": args.max_model_len,
           "max_num_batched_tokens": args.max_tokens, "profile": runner.profile, "attention": attention,
           "cases": results}
    if args.output:
        Path(args.output).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
