"""Offline throughput of a named workload, timed as docs/benchmarks.md asks.

Warm-up, then at least two timed runs of the whole request set; every run is reported
and the best one is the headline. The roofline is computed for the schedule executed.
"""
from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from pathlib import Path

from pagedserve.workloads import VOCAB_DRAW, WorkloadRequest, make_workload

# vLLM's settings for the bar in docs/benchmarks.md.
BENCH_TEMPERATURE = 0.6
DEFAULT_MODELS = {"nanovllm": "qwen3-0.6b", "fixed256": "llama-3.1-8b", "sharegpt-like": "llama-3.1-8b",
                  "alpaca-like": "opt-13b", "shared-prefix": "llama-3.1-8b"}
# The configs ship in the repo (benchmarks/models/), found from this file, not the working directory.
BENCH_MODELS_DIR = Path(__file__).resolve().parents[2] / "benchmarks" / "models"


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


def timed_generate(llm, reqs: list[WorkloadRequest], use_tqdm: bool = False) -> RunResult:
    """use_tqdm: a bar of finished requests with its ETA; its updates cost microseconds per
    request (tqdm redraws at most every 0.1 s), nothing beside a step."""
    prompts, params = _inputs(reqs)
    _sync()
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=use_tqdm)
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


def warm_up_requests(reqs: list[WorkloadRequest], max_tokens: int = 16,
                     vocab: int = VOCAB_DRAW) -> list[WorkloadRequest]:
    """The timed requests' shapes with other token ids and short outputs: every prefill chunk and
    decode batch size of the timed runs meets Triton here, not inside a timed run (a 2-request
    warm-up left the first timed run 17-30% slower on the H200), and no prompt of the timed runs
    is in the prefix cache afterwards."""
    draw = min(VOCAB_DRAW, vocab)
    return [WorkloadRequest([(t + 1) % draw for t in r.prompt_token_ids], min(r.output_len, max_tokens))
            for r in reqs]


def default_model(workload: str) -> str:
    """The workload's model config in benchmarks/models/, wherever the command runs from."""
    path = BENCH_MODELS_DIR / DEFAULT_MODELS[workload]
    if not (path / "config.json").is_file():
        raise ValueError(f"model: the default config for {workload!r} ({path}) is not there (a "
                         "pagedserve installed without its repository); pass --model DIR")
    return str(path)


def progress(message: str) -> None:
    """A line on stderr, so long CPU runs are not silent and stdout stays JSON."""
    print(f"[bench throughput] {message}", file=sys.stderr, flush=True)


def fitted_workload(workload: str, num_requests: int | None, hf_config, max_model_len: int) -> list[WorkloadRequest]:
    """The workload's requests; for a model smaller than it assumes (the demo model: 2,048 ids,
    1,024 positions), token ids below its vocabulary and lengths within max_model_len. For a
    model that fits, exactly the documented draw (docs/benchmarks.md)."""
    from pagedserve.workloads import WORKLOADS
    vocab = getattr(hf_config, "vocab_size", VOCAB_DRAW)
    return make_workload(workload, num_requests,
                         vocab_size=vocab if vocab < VOCAB_DRAW else None,
                         max_total_len=max_model_len if max_model_len < WORKLOADS[workload].max_total_len else None)


def run_throughput(workload: str, model: str, engine_kwargs: dict, num_requests: int | None = None,
                   repeats: int = 2, measure_roofline: bool = True, use_tqdm: bool = False) -> dict:
    """use_tqdm: a progress bar with an ETA over each run's requests (the CLI's default)."""
    from pagedserve import LLM

    progress(f"loading {model} with dummy weights")
    llm = LLM(model, load_format="dummy", skip_tokenizer_init=True, **engine_kwargs)
    hf_config = llm.llm_engine.hf_config
    reqs = fitted_workload(workload, num_requests, hf_config, llm.llm_engine.max_model_len)
    progress(f"warm-up: {len(reqs)} requests of the timed shapes, short outputs")
    t0 = time.perf_counter()
    timed_generate(llm, warm_up_requests(reqs, vocab=getattr(hf_config, "vocab_size", VOCAB_DRAW)), use_tqdm)
    progress(f"warm-up done in {time.perf_counter() - t0:.1f} s")
    runs, hits = [], []
    for i in range(repeats):
        before = llm.get_kv_cache_stats().prefix_cache_hits
        progress(f"timed run {i + 1}/{repeats}: {len(reqs)} requests, "
                 f"{sum(r.output_len for r in reqs)} output tokens")
        runs.append(timed_generate(llm, reqs, use_tqdm))
        progress(f"timed run {i + 1}/{repeats}: {runs[-1].seconds:.2f} s, "
                 f"{runs[-1].output_tokens_per_s:.1f} output tok/s")
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
            from pagedserve.benchmark.hardware import (measure_copy_bandwidth, measure_fp8_matmul_rate,
                                                       measure_matmul_rate)
            from pagedserve.benchmark.roofline import ModelCost
            progress("roofline: recording one more run's schedule, measuring the device")
            log = record_schedule(llm, reqs)
            bw, rate = measure_copy_bandwidth(), measure_matmul_rate()
            # FP8 weights are read at one byte and multiplied at the FP8 rate; an FP8 cache at one byte.
            cost = ModelCost.for_engine(llm.llm_engine)
            fp8_rate = measure_fp8_matmul_rate() if cost.fp8_matmul_params else None
            ideal = log.ideal_seconds(cost, bw, rate, fp8_rate)
            serial = log.serial_ideal_seconds(cost, bw, rate, fp8_rate)
            results.update(measured_copy_bandwidth_GBps=round(bw / 1e9, 1),
                           measured_matmul_TFLOPs=round(rate / 1e12, 1),
                           roofline_ideal_seconds=round(ideal, 3),
                           roofline_serial_ideal_seconds=round(serial, 3), num_steps=len(log.steps))
            if fp8_rate:
                results["measured_fp8_matmul_TFLOPs"] = round(fp8_rate / 1e12, 1)
            ratios["roofline_fraction"] = round(ideal / best.seconds, 3)
            ratios["serial_roofline_fraction"] = round(serial / best.seconds, 3)
    # Taken here, in the process that ran the engine, so the kernels it picked are recorded too.
    from pagedserve.benchmark.results import engine_switches
    switches = engine_switches(llm.llm_engine.config)
    del llm
    return {"results": results, "ratios": ratios, "switches": switches}




def run_throughput_cli(args) -> int:
    import json
    import shlex
    import sys
    from pagedserve.benchmark.results import git_commit, write_result

    from pagedserve.engine_args import changed_engine_kwargs

    from pagedserve.models.loader import get_max_model_len, load_hf_config

    model = args.model or default_model(args.workload)
    # 4096 (the published runs' setting), or the model's own limit when shorter (the demo model's 1024).
    changed = changed_engine_kwargs(args)
    kwargs = {"max_model_len": min(4096, get_max_model_len(load_hf_config(model, changed.get("hf_overrides")))),
              **changed}
    if args.output:
        git_commit()  # refuse before the run, not after it
    out = run_throughput(args.workload, model, kwargs, args.num_requests, args.repeats,
                         use_tqdm=not args.disable_tqdm)
    print(json.dumps(out, indent=2))
    if args.output:
        write_result(args.output, args.workload, "pagedserve bench " + shlex.join(sys.argv[2:]),
                     {"model": model, "workload": args.workload, **kwargs, "temperature": BENCH_TEMPERATURE},
                     out["results"], {}, out["ratios"], switches=out["switches"])
    return 0
