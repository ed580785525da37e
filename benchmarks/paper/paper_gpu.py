"""The paper's GPU experiments inside pagedserve, on the H200 with dummy weights.

Sections (each writes its own results file, and a failing one does not stop the rest):
  serving_load       Figures 12/13: Poisson arrivals at swept rates, paged vs the three
                     contiguous baselines in the same engine and KV budget.
  block_size         Figure 18b: end-to-end throughput per block size, and (swap_vs_recompute.json)
                     Figure 19a: the cost of preemption by swap and by recompute, per block size.
  shared_prefix      The seed's scenario: 100 users, one 5,000-token system prompt.
  memory             Figure 2 on the GPU engine: the sim's requests and settings, the engine's
                     KVCacheStats step by step beside the sim's (memory_breakdown.json).
Figure 2 is also measured on the GPU engine during serving_load (memory_breakdown_gpu_engine).

--model/--bs-model/--sp-model take a config name under benchmarks/models or a model directory,
and --device cpu runs the same code on a tiny model: tests/benchmark/test_paper_gpu_smoke.py
uses that to check the script's logic in CI before device time is spent on it.
"""
from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import torch  # noqa: E402

from pagedserve import SamplingParams  # noqa: E402
from pagedserve.benchmark.replay import replay  # noqa: E402
from pagedserve.benchmark.results import git_commit, write_result  # noqa: E402
from pagedserve.benchmark.sustained import crossing_rate  # noqa: E402
from pagedserve.config import EngineConfig  # noqa: E402
from pagedserve.core.scheduler import Scheduler  # noqa: E402
from pagedserve.engine.llm_engine import LLMEngine  # noqa: E402
from pagedserve.sim import KV_BUDGET_TOKENS, simulate  # noqa: E402
from pagedserve.workloads import WORKLOADS, make_workload  # noqa: E402

MODELS = Path(__file__).resolve().parents[1] / "models"
# The order the sweep runs them: the two the ratios need first, so a run cut short keeps them.
ALLOCATORS = ["paged", "contiguous-oracle", "contiguous-max", "contiguous-pow2"]
# The paper's setting: OPT-13B on an A100-40GB leaves about 12 GB for KV (26 GB of fp16 weights).
PAPER_KV_BYTES = 12e9


def model_dir(model: str) -> Path:
    return Path(model) if Path(model).is_dir() else MODELS / model


def kv_bytes_per_token(model: str) -> int:
    cfg = json.loads((model_dir(model) / "config.json").read_text())
    heads = cfg["num_attention_heads"]
    kv_heads = cfg.get("num_key_value_heads", heads)
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    return cfg["num_hidden_layers"] * 2 * kv_heads * head_dim * 2


ARGS = argparse.Namespace(device="cuda", dtype="bfloat16", max_output=None)


def make_engine(model: str, **kw) -> LLMEngine:
    base = dict(model=str(model_dir(model)), load_format="dummy", skip_tokenizer_init=True, dtype=ARGS.dtype,
                device=ARGS.device)
    return LLMEngine(EngineConfig(**{**base, **kw}))


def sync() -> None:
    if ARGS.device == "cuda":
        torch.cuda.synchronize()


def out_len(r) -> int:
    return r.output_len if ARGS.max_output is None else min(r.output_len, ARGS.max_output)


def params(r) -> SamplingParams:
    return SamplingParams(temperature=0.6, max_tokens=out_len(r), ignore_eos=True)


def workload(eng: LLMEngine, name: str, n: int | None = None, rate: float | None = None,
             shared_prefix_len: int | None = None) -> list:
    """docs/benchmarks.md's workload; token ids folded into the vocabulary (a no-op for the real configs,
    whose vocabularies exceed the 10,000 ids drawn, but not for the smoke test's tiny model)."""
    reqs = make_workload(name, n, request_rate=rate, shared_prefix_len=shared_prefix_len)
    for r in reqs:
        r.prompt_token_ids = [t % eng.vocab_size for t in r.prompt_token_ids]
    return reqs


def use_scheduler(eng: LLMEngine, **cache_changes) -> None:
    """Give the same engine (weights, KV pools, CUDA graphs) a fresh scheduler with another policy:
    paged vs contiguous, or prefix caching on/off, compared on identical kernels and memory."""
    for k, v in cache_changes.items():
        setattr(eng.cache_config, k, v)
    eng.use_scheduler(Scheduler(eng.scheduler_config, eng.cache_config))


class BreakdownMeter:
    """Figure 2 on the GPU engine: the occupied-KV split averaged over steps."""

    def __init__(self):
        self.sums, self.steps = {}, 0

    def __call__(self, eng) -> None:
        fr = eng.scheduler.get_memory_breakdown().fractions()
        if sum(fr.values()) > 0:
            for k, v in fr.items():
                self.sums[k] = self.sums.get(k, 0.0) + v
            self.steps += 1

    def mean(self) -> dict:
        return {k: round(v / self.steps, 4) for k, v in self.sums.items()} if self.steps else {}


def warm_up(eng: LLMEngine, reqs: list, cap: int = 32) -> None:
    """Untimed runs that make Triton compile every kernel variant the timed runs will meet: a batch
    at t=0 (prefill chunks of many sizes, every decode graph bucket) and a short Poisson replay
    (lone prefills mixed into decode steps). Outputs are capped: only the shapes matter here."""
    short = lambda r: SamplingParams(temperature=0.6, max_tokens=min(out_len(r), cap), ignore_eos=True)  # noqa: E731
    replay(eng, reqs, short, realtime=False)
    replay(eng, reqs[: len(reqs) // 2], short, realtime=True)


def serving_load(args, save) -> dict:
    """Figures 12/13. Each rate replays a fixed arrival window (rate x --window-s requests, at least
    --min-requests), so a rate above an allocator's capacity builds a queue that grows with the
    rate, as in the paper's long traces. An allocator stops at its first point above the latency
    threshold: it has already turned up there, and its later points would only take device time.
    One that is above it at the lowest rate gets one point at half that rate, to find its crossing."""
    model = args.model
    block_size = 16
    num_blocks = int(args.kv_budget_gb * 1e9 / kv_bytes_per_token(model) / block_size)
    rates = [float(x) for x in args.rates.split(",")]
    eng = make_engine(model, num_gpu_blocks_override=num_blocks, max_model_len=2048,
                      enable_prefix_caching=False, block_size=block_size, max_num_seqs=256)
    warm_up(eng, workload(eng, "sharegpt-like", 64, rate=16.0))
    config = {"model": model, "workload": "sharegpt-like", "rates": rates, "window_s": args.window_s,
              "min_requests": args.min_requests, "block_size": block_size, "num_gpu_blocks": num_blocks,
              "kv_budget_bytes": args.kv_budget_gb * 1e9,
              "sustained_rate_note": "highest rate (interpolated) whose normalized latency stays under the "
                                     "threshold = 2x paged's at the lowest rate; sustained_rate_bound says "
                                     "'lower' where a curve never crossed (the value is the highest rate run) "
                                     "and 'upper' where it crossed at the lowest rate (the value is that rate)"}
    curves, breakdown, threshold = {}, {}, None
    doc = None
    for alloc in args.allocators.split(","):
        use_scheduler(eng, kv_allocator=alloc)
        pts, meter = [], BreakdownMeter()
        todo = list(rates)
        while todo:
            rate = todo.pop(0)
            n = max(args.min_requests, round(rate * args.window_s))
            res = replay(eng, workload(eng, "sharegpt-like", n, rate=rate), params, on_step=meter).summary()
            res["rate"] = rate
            pts.append(res)
            print(alloc, json.dumps(res), flush=True)
            if threshold is None:  # the first point of the first allocator (paged) sets it
                threshold = 2 * res["normalized_latency_s_per_token"]
            if res["normalized_latency_s_per_token"] > threshold:
                if len(pts) == 1:
                    todo = [rate / 2]  # above it already at the lowest rate: look below, or there is no crossing
                    continue
                break
        pts.sort(key=lambda p: p["rate"])
        curves[alloc], breakdown[alloc] = pts, meter.mean()
        doc = load_doc(config, threshold, curves, breakdown)
        save(doc)  # after every allocator, so a run cut short keeps what it measured
    return doc


def load_doc(config: dict, threshold: float, curves: dict, breakdown: dict) -> dict:
    sustained, bound = {}, {}
    for a, pts in curves.items():
        lat = [(p["rate"], p["normalized_latency_s_per_token"]) for p in pts]
        sustained[a] = crossing_rate(lat, threshold)
        if sustained[a] is None:
            sustained[a], bound[a] = lat[0][0], "upper"
        elif all(v <= threshold for _, v in lat):
            bound[a] = "lower"
    ratios = {}
    for a, key in (("contiguous-oracle", "rate_vs_contiguous_oracle"), ("contiguous-max", "rate_vs_contiguous_max"),
                   ("contiguous-pow2", "rate_vs_contiguous_pow2")):
        if "paged" in sustained and a in sustained:
            ratios[key] = round(sustained["paged"] / sustained[a], 2)
    return {"config": {**config, "latency_threshold_s_per_token": threshold},
            "results": {"curves": curves, "sustained_rate": sustained, "sustained_rate_bound": bound,
                        "memory_breakdown_gpu_engine": breakdown},
            "ratios": ratios}


def time_swap_and_recompute(eng: LLMEngine, ntok: int) -> dict:
    """Figure 19a: moving ntok tokens' KV out to the CPU pool and back, against recomputing them."""
    ce, bs = eng.runner.cache_engine, eng.cache_config.block_size
    pairs = [(i, i) for i in range((ntok + bs - 1) // bs)]
    for _ in range(2):
        ce.swap_out(pairs)
        ce.swap_in(pairs)
    sync()
    t0 = time.perf_counter()
    for _ in range(5):
        ce.swap_out(pairs)
        ce.swap_in(pairs)
    sync()
    swap_s = (time.perf_counter() - t0) / 5
    ids = [t % eng.vocab_size for t in make_workload("fixed256", 1)[0].prompt_token_ids * (ntok // 256 + 1)][:ntok]
    use_scheduler(eng, enable_prefix_caching=False)
    times = []
    for i in range(4):
        t0 = time.perf_counter()
        eng.add_request(f"recompute{i}", {"prompt_token_ids": ids}, SamplingParams(max_tokens=1))
        while eng.has_unfinished_requests():
            eng.step()
        sync()
        times.append(time.perf_counter() - t0)
    return {"tokens": ntok, "blocks": len(pairs), "swap_out_in_s": round(swap_s, 5),
            "recompute_s": round(min(times[1:]), 5)}


def block_size_sweep(args, save) -> dict:
    """Figure 18b (end-to-end throughput per block size) and Figure 19a, one engine per block size.
    Each block size first replays the very requests it is timed on, untimed, so no kernel variant is
    compiled inside the timed run (the first H200 run showed 1-2 s TTFTs from exactly that)."""
    rows, svr = {}, {}
    cfg = {"model": args.bs_model, "workload": "sharegpt-like", "num_requests": args.bs_requests,
           "max_model_len": args.bs_max_model_len, "arrivals": "all at t=0, after an untimed replay of the same requests"}
    doc = None
    for bs in [int(x) for x in args.block_sizes.split(",")]:
        eng = None
        try:
            eng = make_engine(args.bs_model, block_size=bs, max_model_len=args.bs_max_model_len,
                              enable_prefix_caching=False)
            reqs = workload(eng, "sharegpt-like", args.bs_requests)
            replay(eng, reqs, params, realtime=False)
            rows[bs] = replay(eng, reqs, params, realtime=False).summary()
            print("block", bs, json.dumps(rows[bs]), flush=True)
        except Exception as e:
            traceback.print_exc()
            rows[bs] = {"error": f"{type(e).__name__}: {e}"[:300]}
        try:
            if eng is not None:
                svr[bs] = time_swap_and_recompute(eng, min(args.svr_tokens, eng.max_model_len - 1))
                print("svr", bs, svr[bs], flush=True)
        except Exception as e:
            traceback.print_exc()
            svr[bs] = {"error": f"{type(e).__name__}: {e}"[:300]}
        eng = None
        if ARGS.device == "cuda":
            torch.cuda.empty_cache()
        doc = block_size_docs(cfg, args.svr_tokens, rows, svr)
        save(doc)
    return doc


def block_size_docs(cfg: dict, svr_tokens: int, rows: dict, svr: dict) -> dict:
    ok = {b: r for b, r in rows.items() if "output_tokens_per_s" in r}
    svr_ok = {b: r for b, r in svr.items() if "recompute_s" in r}
    best = max((r["output_tokens_per_s"] for r in ok.values()), default=None)
    return {"block_size": {"config": cfg, "results": {"by_block_size": rows},
                           "ratios": {"block16_over_best_throughput": round(ok[16]["output_tokens_per_s"] / best, 3)}
                           if 16 in ok else {}},
            "swap_vs_recompute": {"config": {**cfg, "tokens": svr_tokens}, "results": {"by_block_size": svr},
                                  "ratios": {"swap_over_recompute_block16":
                                             # 3 significant digits: on a CPU swap can be 1000x cheaper
                                             float(f'{svr_ok[16]["swap_out_in_s"] / svr_ok[16]["recompute_s"]:.3g}')}
                                  if 16 in svr_ok else {}}}


def shared_prefix(args, save) -> dict:
    """The seed's scenario: 100 users, one long system prompt; prefix caching off, then on."""
    eng = make_engine(args.sp_model, max_model_len=8192)
    reqs_all = workload(eng, "shared-prefix", args.sp_users, rate=args.sp_rate, shared_prefix_len=args.sp_prefix_len)
    # Warm-up (caching on, the default) on prompts of the same shapes with another shared prefix, so
    # the prefix-hit kernel variants compile here; the fresh schedulers below start with empty caches.
    warm_up(eng, [type(r)([(t + 1) % eng.vocab_size for t in r.prompt_token_ids], r.output_len, r.arrival_time)
                  for r in reqs_all[:16]])
    out = {}
    for caching in (False, True):
        use_scheduler(eng, enable_prefix_caching=caching)
        res = replay(eng, reqs_all, lambda r: SamplingParams(temperature=0.0, max_tokens=out_len(r), ignore_eos=True))
        s = res.summary()
        half = len(res.ttft_by_arrival) // 2
        s["ttft_first_user_s"] = round(res.ttft_by_arrival[0], 4)
        s["mean_ttft_later_half_s"] = round(sum(res.ttft_by_arrival[half:]) / len(res.ttft_by_arrival[half:]), 4)
        st = eng.get_kv_cache_stats()
        s.update(prefix_cache_queries=st.prefix_cache_queries, prefix_cache_hits=st.prefix_cache_hits)
        out["cached" if caching else "uncached"] = s
        print("shared_prefix", caching, json.dumps(s), flush=True)
    c, u = out["cached"], out["uncached"]
    return {"config": {"model": args.sp_model, "workload": "shared-prefix", "users": len(reqs_all),
                       "request_rate": args.sp_rate,
                       "prefix_len": WORKLOADS["shared-prefix"].shared_prefix_len if args.sp_prefix_len is None
                       else args.sp_prefix_len},
            "results": out,
            "ratios": {"kv_blocks_saved_fraction": round(1 - c["peak_blocks_used"] / u["peak_blocks_used"], 3),
                       "ttft_speedup_cached": round(u["mean_ttft_s"] / c["mean_ttft_s"], 2)}}


def memory(args, save) -> dict:
    """Figure 2 on the GPU engine, on exactly the sim's requests and settings: both workloads, every
    allocator, all --mem-requests requests queued at t=0, the sim's KV budget, preemption by
    recompute, prefix caching off. Nothing the scheduler sees differs from the sim (outputs end
    at their workload lengths; token values do not matter to it), so its decisions, and so the
    memory split, must be the sim's step for step; the JSON gives both, over the first
    --mem-steps steps, and the largest difference of any share at any step."""
    block_size, steps = 16, args.mem_steps
    num_blocks = KV_BUDGET_TOKENS // block_size
    # Synchronous steps, as the sim takes them: overlapped ones plan (and allocate for) step N+1
    # before step() returns N's outputs, so the split would be read one step ahead of the sim's.
    eng = make_engine(args.model, num_gpu_blocks_override=num_blocks, max_model_len=2048, block_size=block_size,
                      enable_prefix_caching=False, preemption_mode="recompute", max_num_seqs=256,
                      max_num_batched_tokens=8192, async_scheduling=False)
    rows = {}
    for w in ("sharegpt-like", "alpaca-like"):
        reqs = workload(eng, w, args.mem_requests)
        for alloc in ALLOCATORS:
            use_scheduler(eng, kv_allocator=alloc)
            ids = [f"{w}/{alloc}/{i}" for i in range(len(reqs))]
            for rid, r in zip(ids, reqs):
                eng.add_request(rid, {"prompt_token_ids": r.prompt_token_ids},  # full lengths, as in the sim
                                SamplingParams(temperature=0.6, max_tokens=r.output_len, ignore_eos=True))
            gpu = []
            t0 = time.perf_counter()
            while eng.has_unfinished_requests() and len(gpu) < steps:
                eng.step(final_only=True)
                gpu.append(eng.scheduler.get_memory_breakdown().fractions())
            seconds = time.perf_counter() - t0
            eng.abort_request(ids)
            sim = []
            simulate(workload=w, allocator=alloc, block_size=block_size, num_blocks=num_blocks,
                     num_requests=args.mem_requests, max_model_len=2048, preemption_mode="recompute",
                     enable_prefix_caching=False, max_steps=steps,
                     on_step=lambda _s, sch: sim.append(sch.get_memory_breakdown().fractions()))
            diff = max((abs(g[k] - s_[k]) for g, s_ in zip(gpu, sim) for k in g), default=None)
            mean = lambda xs: {k: round(sum(x[k] for x in xs) / len(xs), 4) for k in xs[0]}  # noqa: E731
            rows.setdefault(w, {})[alloc] = {
                "steps_gpu": len(gpu), "steps_sim": len(sim), "gpu_seconds": round(seconds, 2),
                "breakdown_gpu_engine": mean(gpu), "breakdown_sim": mean(sim), "max_abs_step_difference": diff}
            print("memory", w, alloc, json.dumps(rows[w][alloc]), flush=True)
    diffs = [r["max_abs_step_difference"] for by in rows.values() for r in by.values()]
    config = {"model": args.model, "num_requests": args.mem_requests, "steps": steps, "block_size": block_size,
              "num_gpu_blocks": num_blocks, "arrivals": "all at t=0", "preemption_mode": "recompute",
              "enable_prefix_caching": False}
    ratios = {"max_abs_step_difference_gpu_vs_sim": None if None in diffs else max(diffs)}
    ratios.update({f"{w}.{a}.token_states_gpu": r["breakdown_gpu_engine"]["token_states"]
                   for w, by in rows.items() for a, r in by.items()})
    return {"memory_breakdown": {"config": config, "results": rows, "ratios": ratios}}

SECTIONS = {"memory": memory, "serving_load": serving_load, "block_size": block_size_sweep, "shared_prefix": shared_prefix}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sections", default=",".join(SECTIONS))
    ap.add_argument("--out-dir", default="benchmarks/results/h200")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--max-output", type=int, default=None, help="cap every output length (smoke tests only)")
    ap.add_argument("--model", default="opt-13b")
    ap.add_argument("--kv-budget-gb", type=float, default=PAPER_KV_BYTES / 1e9)
    ap.add_argument("--allocators", default=",".join(ALLOCATORS))
    ap.add_argument("--rates", default="1,2,4,8,12")
    ap.add_argument("--window-s", type=float, default=20.0)
    ap.add_argument("--min-requests", type=int, default=20)
    ap.add_argument("--block-sizes", default="1,8,16,32,64,128,256")
    ap.add_argument("--bs-model", default="qwen3-0.6b")
    ap.add_argument("--bs-requests", type=int, default=200)
    ap.add_argument("--bs-max-model-len", type=int, default=2048)
    ap.add_argument("--svr-tokens", type=int, default=2048)
    ap.add_argument("--sp-model", default="llama-3.1-8b")
    ap.add_argument("--sp-users", type=int, default=None)
    ap.add_argument("--sp-rate", type=float, default=20.0)
    ap.add_argument("--sp-prefix-len", type=int, default=None,
                    help="tokens of the users' shared system prompt (default: the workload's 5,000)")
    ap.add_argument("--mem-requests", type=int, default=1000)
    ap.add_argument("--mem-steps", type=int, default=400)
    args = ap.parse_args(argv)
    git_commit()  # refuse before measuring, not after
    ARGS.device, ARGS.dtype, ARGS.max_output = args.device, args.dtype, args.max_output
    command = "python benchmarks/paper/paper_gpu.py " + shlex.join(sys.argv[1:] if argv is None else argv)

    def save(doc: dict) -> None:
        docs = doc if "config" not in doc else {name: doc}
        for fname, d in docs.items():
            write_result(Path(args.out_dir) / f"{fname}.json", fname, command, d["config"], d["results"],
                         d.get("baselines", {}), d["ratios"])

    failed = []
    for name in args.sections.split(","):
        try:
            save(SECTIONS[name](args, save))
        except Exception:
            traceback.print_exc()
            print(f"section {name} failed", flush=True)
            failed.append(name)
    if failed:
        sys.exit(f"sections failed: {','.join(failed)}")


if __name__ == "__main__":
    main()
