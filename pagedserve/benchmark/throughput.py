"""Offline throughput of a named workload, timed as BENCHMARKS.md asks.

Warm-up, then at least two timed runs of the whole request set; every run is reported
and the best one is the headline. The roofline is computed for the schedule executed.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

from pagedserve.workloads import VOCAB_DRAW, WorkloadRequest, make_workload

# vLLM's settings for the bar in BENCHMARKS.md.
BENCH_TEMPERATURE = 0.6
DEFAULT_MODELS = {"nanovllm": "benchmarks/models/qwen3-0.6b", "fixed256": "benchmarks/models/llama-3.1-8b",
                  "sharegpt-like": "benchmarks/models/llama-3.1-8b", "alpaca-like": "benchmarks/models/opt-13b",
                  "shared-prefix": "benchmarks/models/llama-3.1-8b"}


@dataclass
class RunResult:
    seconds: float
    prompt_tokens: int
    output_tokens: int
    num_requests: int

    @property
    def output_tokens_per_s(self) -> float:
        return self.output_tokens / self.seconds

    @property
    def total_tokens_per_s(self) -> float:
        return (self.prompt_tokens + self.output_tokens) / self.seconds

    @property
    def requests_per_s(self) -> float:
        return self.num_requests / self.seconds


def _inputs(reqs: list[WorkloadRequest]):
    from pagedserve import SamplingParams
    prompts = [{"prompt_token_ids": r.prompt_token_ids} for r in reqs]
    params = [SamplingParams(temperature=BENCH_TEMPERATURE, max_tokens=r.output_len, ignore_eos=True, seed=None)
              for r in reqs]
    return prompts, params


def _sync() -> None:
    import torch
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed_generate(llm, reqs: list[WorkloadRequest]) -> RunResult:
    prompts, params = _inputs(reqs)
    _sync()
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    _sync()
    dt = time.perf_counter() - t0
    out_tokens = sum(len(c.token_ids) for o in outs for c in o.outputs)
    return RunResult(dt, sum(len(r.prompt_token_ids) for r in reqs), out_tokens, len(reqs))


def record_schedule(llm, reqs: list[WorkloadRequest]):
    """Run the requests once more, logging every step's schedule for the roofline."""
    from pagedserve.benchmark.roofline import StepLog
    log = StepLog()
    sched = llm.llm_engine.scheduler
    original = sched.schedule

    def logged():
        out = original()
        log.record(out)
        return out
    sched.schedule = logged
    try:
        prompts, params = _inputs(reqs)
        llm.generate(prompts, params, use_tqdm=False)
    finally:
        sched.schedule = original
    return log


def warm_up_requests(reqs: list[WorkloadRequest], max_tokens: int = 16) -> list[WorkloadRequest]:
    """The timed requests' shapes with other token ids and short outputs: every prefill chunk and
    decode batch size of the timed runs meets Triton here, not inside a timed run (a 2-request
    warm-up left the first timed run 17-30% slower on the H200), and no prompt of the timed runs
    is in the prefix cache afterwards."""
    return [WorkloadRequest([(t + 1) % VOCAB_DRAW for t in r.prompt_token_ids], min(r.output_len, max_tokens))
            for r in reqs]


def run_throughput(workload: str, model: str, engine_kwargs: dict, num_requests: int | None = None,
                   repeats: int = 2, measure_roofline: bool = True) -> dict:
    from pagedserve import LLM

    reqs = make_workload(workload, num_requests)
    llm = LLM(model, load_format="dummy", skip_tokenizer_init=True, **engine_kwargs)
    timed_generate(llm, warm_up_requests(reqs))
    runs, hits = [], []
    for _ in range(repeats):
        before = llm.get_kv_cache_stats().prefix_cache_hits
        runs.append(timed_generate(llm, reqs))
        # Prefix caching is on by default here as in vLLM's run of the bar, so a repeat of the same
        # prompts finds them cached; reported so that nobody mistakes it for prefill speed.
        hits.append(llm.get_kv_cache_stats().prefix_cache_hits - before)
    best = min(runs, key=lambda r: r.seconds)
    results = {
        "num_requests": len(reqs), "prompt_tokens": best.prompt_tokens, "output_tokens": best.output_tokens,
        "seconds": round(best.seconds, 3),
        "output_tokens_per_s": round(best.output_tokens_per_s, 1),
        "total_tokens_per_s": round(best.total_tokens_per_s, 1),
        "requests_per_s": round(best.requests_per_s, 2),
        "runs": [{"seconds": round(r.seconds, 3), "output_tokens_per_s": round(r.output_tokens_per_s, 1),
                  "requests_per_s": round(r.requests_per_s, 2), "prefix_cache_hit_tokens": h}
                 for r, h in zip(runs, hits)],
        "num_gpu_blocks": llm.get_kv_cache_stats().num_blocks_total,
    }
    ratios = {}
    if measure_roofline:
        import torch
        if torch.cuda.is_available():
            from pagedserve.benchmark.hardware import measure_copy_bandwidth, measure_matmul_rate
            from pagedserve.benchmark.roofline import ModelCost
            log = record_schedule(llm, reqs)
            bw, rate = measure_copy_bandwidth(), measure_matmul_rate()
            cost = ModelCost.from_hf_config(llm.llm_engine.hf_config)
            ideal = log.ideal_seconds(cost, bw, rate)
            results.update(measured_copy_bandwidth_GBps=round(bw / 1e9, 1),
                           measured_matmul_TFLOPs=round(rate / 1e12, 1),
                           roofline_ideal_seconds=round(ideal, 3), num_steps=len(log.steps))
            ratios["roofline_fraction"] = round(ideal / best.seconds, 3)
    del llm
    return {"results": results, "ratios": ratios}


def engine_kwargs_from_args(args) -> dict:
    from pagedserve.entrypoints.cli import engine_config_from_args
    import dataclasses
    cfg = engine_config_from_args(args, model=None)
    defaults = type(cfg)()
    return {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)
            if f.name not in ("model", "extra") and getattr(cfg, f.name) != getattr(defaults, f.name)}


def run_throughput_cli(args) -> int:
    import json
    import shlex
    import sys
    from pagedserve.benchmark.hardware import write_result

    model = args.model or DEFAULT_MODELS.get(args.workload)
    if model is None:
        raise ValueError(f"--model is required for workload {args.workload!r}")
    kwargs = {"max_model_len": 4096, **engine_kwargs_from_args(args)}
    out = run_throughput(args.workload, model, kwargs, args.num_requests, args.repeats)
    print(json.dumps(out, indent=2))
    if args.output:
        write_result(args.output, args.workload, "pagedserve bench " + shlex.join(sys.argv[2:]),
                     {"model": model, "workload": args.workload, "async_scheduling": True, **kwargs,
                      "temperature": BENCH_TEMPERATURE},
                     out["results"], {}, out["ratios"])
    return 0
