"""The paper's GPU experiments inside pagedserve, on the H200 with dummy weights.

Sections (each writes its own results file, and a failing one does not stop the rest):
  serving_load       Figures 12/13: Poisson arrivals at swept rates, paged vs the three
                     contiguous baselines in the same engine and KV budget.
  block_size         Figure 18b: end-to-end throughput per block size.
  swap_vs_recompute  Figure 19: cost of preemption by swap and by recompute, per block size.
  shared_prefix      The seed's scenario: 100 users, one 5,000-token system prompt.
  kv_breakdown       Figure 2 confirmed on the GPU engine from KVCacheStats.
"""
from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import torch  # noqa: E402

from pagedserve import SamplingParams  # noqa: E402
from pagedserve.benchmark.hardware import write_result  # noqa: E402
from pagedserve.benchmark.replay import replay  # noqa: E402
from pagedserve.config import EngineConfig  # noqa: E402
from pagedserve.engine.llm_engine import LLMEngine  # noqa: E402
from pagedserve.workloads import make_workload  # noqa: E402

MODELS = Path(__file__).resolve().parent / "models"
ALLOCATORS = ["paged", "contiguous-oracle", "contiguous-pow2", "contiguous-max"]
# The paper's setting: OPT-13B on an A100-40GB leaves about 12 GB for KV (26 GB of fp16 weights).
PAPER_KV_BYTES = 12e9


def kv_bytes_per_token(model: str) -> int:
    cfg = json.loads((MODELS / model / "config.json").read_text())
    heads = cfg["num_attention_heads"]
    kv_heads = cfg.get("num_key_value_heads", heads)
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    return cfg["num_hidden_layers"] * 2 * kv_heads * head_dim * 2


def make_engine(model: str, **kw) -> LLMEngine:
    base = dict(model=str(MODELS / model), load_format="dummy", skip_tokenizer_init=True, dtype="bfloat16")
    return LLMEngine(EngineConfig(**{**base, **kw}))


def params(r) -> SamplingParams:
    return SamplingParams(temperature=0.6, max_tokens=r.output_len, ignore_eos=True)


def crossing_rate(points: list[tuple[float, float]], threshold: float) -> float | None:
    """Highest rate whose normalized latency stays under threshold, interpolated between sweep points."""
    best = None
    for (r0, l0), (r1, l1) in zip(points, points[1:] + [(None, None)]):
        if l0 > threshold:
            break
        best = r0
        if r1 is not None and l1 > threshold:
            best = r0 + (r1 - r0) * (threshold - l0) / (l1 - l0)
            break
    return best


def serving_load(args) -> dict:
    model = args.model
    block_size = 16
    num_blocks = int(PAPER_KV_BYTES / kv_bytes_per_token(model) / block_size)
    rates = [float(x) for x in args.rates.split(",")]
    curves = {}
    for alloc in args.allocators.split(","):
        eng = make_engine(model, kv_allocator=alloc, num_gpu_blocks_override=num_blocks, max_model_len=2048,
                          enable_prefix_caching=False, block_size=block_size)
        eng_pts = []
        for rate in rates:
            reqs = make_workload("sharegpt-like", args.num_requests, request_rate=rate)
            res = replay(eng, reqs, params).summary()
            res["rate"] = rate
            eng_pts.append(res)
            print(alloc, json.dumps(res), flush=True)
        curves[alloc] = eng_pts
        del eng
        torch.cuda.empty_cache()
    # Equal latency: twice paged's normalized latency at the lowest rate.
    threshold = 2 * curves["paged"][0]["normalized_latency_s_per_token"] if "paged" in curves else None
    sustained = {a: crossing_rate([(p["rate"], p["normalized_latency_s_per_token"]) for p in pts], threshold)
                 for a, pts in curves.items()}
    ratios = {}
    for a, key in (("contiguous-oracle", "rate_vs_contiguous_oracle"), ("contiguous-max", "rate_vs_contiguous_max"),
                   ("contiguous-pow2", "rate_vs_contiguous_pow2")):
        if sustained.get("paged") and sustained.get(a):
            ratios[key] = round(sustained["paged"] / sustained[a], 2)
    return {"config": {"model": model, "workload": "sharegpt-like", "num_requests": args.num_requests,
                       "rates": rates, "block_size": block_size, "num_gpu_blocks": num_blocks,
                       "kv_budget_bytes": PAPER_KV_BYTES, "latency_threshold_s_per_token": threshold},
            "results": {"curves": curves, "sustained_rate": sustained}, "ratios": ratios}


def block_size_sweep(args) -> dict:
    rows = {}
    for bs in [int(x) for x in args.block_sizes.split(",")]:
        eng = make_engine(args.bs_model, block_size=bs, max_model_len=2048)
        reqs = make_workload("sharegpt-like", args.bs_requests)
        replay(eng, reqs[:4], params, realtime=False)
        res = replay(eng, reqs, params, realtime=False).summary()
        rows[bs] = res
        print("block", bs, json.dumps(res), flush=True)
        del eng
        torch.cuda.empty_cache()
    best = max(r["output_tokens_per_s"] for r in rows.values())
    return {"config": {"model": args.bs_model, "workload": "sharegpt-like", "num_requests": args.bs_requests},
            "results": {"by_block_size": rows},
            "ratios": {"block16_over_best_throughput": round(rows[16]["output_tokens_per_s"] / best, 3)
                       if 16 in rows else None}}


def swap_vs_recompute(args) -> dict:
    """Per block size: the time to swap N tokens out and back in against recomputing them."""
    rows = {}
    ntok = args.svr_tokens
    for bs in [int(x) for x in args.block_sizes.split(",")]:
        eng = make_engine(args.bs_model, block_size=bs, max_model_len=4096, enable_prefix_caching=False)
        ce = eng.model_runner.cache_engine
        nb = (ntok + bs - 1) // bs
        pairs_out = [(i, i) for i in range(nb)]
        for _ in range(2):
            ce.swap_out(pairs_out)
            ce.swap_in(pairs_out)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(5):
            ce.swap_out(pairs_out)
            ce.swap_in(pairs_out)
        torch.cuda.synchronize()
        swap_s = (time.perf_counter() - t0) / 5
        reqs = make_workload("fixed256", 1)
        reqs[0].prompt_token_ids = (reqs[0].prompt_token_ids * (ntok // 256 + 1))[:ntok]
        reqs[0].output_len = 1
        replay(eng, reqs, params, realtime=False)
        t0 = time.perf_counter()
        for i in range(3):
            eng.add_request(f"r{i}", {"prompt_token_ids": reqs[0].prompt_token_ids}, SamplingParams(max_tokens=1))
            while eng.has_unfinished_requests():
                eng.step()
        torch.cuda.synchronize()
        recompute_s = (time.perf_counter() - t0) / 3
        rows[bs] = {"tokens": ntok, "swap_out_in_s": round(swap_s, 5), "recompute_s": round(recompute_s, 5)}
        print("svr", bs, rows[bs], flush=True)
        del eng
        torch.cuda.empty_cache()
    return {"config": {"model": args.bs_model, "tokens": ntok}, "results": {"by_block_size": rows},
            "ratios": {"swap_over_recompute_block16": round(rows[16]["swap_out_in_s"] / rows[16]["recompute_s"], 3)
                       if 16 in rows else None}}


def shared_prefix(args) -> dict:
    out = {}
    for caching in (False, True):
        eng = make_engine("llama-3.1-8b", enable_prefix_caching=caching, max_model_len=8192)
        reqs = make_workload("shared-prefix", request_rate=args.sp_rate)
        res = replay(eng, reqs, lambda r: SamplingParams(temperature=0.0, max_tokens=r.output_len, ignore_eos=True))
        s = res.summary()
        half = len(res.ttft_s) // 2
        s["mean_ttft_later_half_s"] = round(sum(sorted(res.ttft_s)[:half]) / half, 4)
        st = eng.get_kv_cache_stats()
        s.update(prefix_cache_queries=st.prefix_cache_queries, prefix_cache_hits=st.prefix_cache_hits)
        out["cached" if caching else "uncached"] = s
        print("shared_prefix", caching, json.dumps(s), flush=True)
        del eng
        torch.cuda.empty_cache()
    c, u = out["cached"], out["uncached"]
    return {"config": {"model": "llama-3.1-8b", "workload": "shared-prefix", "request_rate": args.sp_rate},
            "results": out,
            "ratios": {"kv_blocks_saved_fraction": round(1 - c["peak_blocks_used"] / u["peak_blocks_used"], 3),
                       "ttft_speedup_cached": round(u["mean_ttft_s"] / c["mean_ttft_s"], 2)}}


SECTIONS = {"serving_load": serving_load, "block_size": block_size_sweep,
            "swap_vs_recompute": swap_vs_recompute, "shared_prefix": shared_prefix}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sections", default=",".join(SECTIONS))
    ap.add_argument("--out-dir", default="benchmarks/results/h200")
    ap.add_argument("--model", default="opt-13b")
    ap.add_argument("--allocators", default=",".join(ALLOCATORS))
    ap.add_argument("--rates", default="4,8,12,16")
    ap.add_argument("--num-requests", type=int, default=200)
    ap.add_argument("--block-sizes", default="1,8,16,32,64,128,256")
    ap.add_argument("--bs-model", default="qwen3-0.6b")
    ap.add_argument("--bs-requests", type=int, default=200)
    ap.add_argument("--svr-tokens", type=int, default=2048)
    ap.add_argument("--sp-rate", type=float, default=20.0)
    args = ap.parse_args()
    command = "python benchmarks/paper_gpu.py " + shlex.join(sys.argv[1:])
    for name in args.sections.split(","):
        try:
            doc = SECTIONS[name](args)
            write_result(Path(args.out_dir) / f"{name}.json", name, command, doc["config"], doc["results"],
                         doc.get("baselines", {}), doc["ratios"])
        except Exception:
            traceback.print_exc()
            print(f"section {name} failed", flush=True)


if __name__ == "__main__":
    main()
