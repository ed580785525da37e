"""One engine, every workload: a MoE model's offline runs with one start-up (moe_offline.py --one-engine).

Each workload is timed as `pagedserve bench throughput` times it (pagedserve/benchmark/throughput.py:
a warm-up of the timed shapes with other token ids, then `repeats` timed runs, the first with a cold
prefix cache), one workload after the other on the same LLM, as bench_vllm.py --also does for vLLM.
Why: a start-up of Mixtral-8x7B's dummy weights takes minutes of a 10-minute device call, and the
two workloads draw different token ids, so the second finds nothing of the first in the cache
(`prefix_cache_hit_tokens` of its first run says so).

For the workloads in `traced`, one more run (after the timed ones, so its prompts are cached, as
bench throughput's roofline run) records the schedule and the step trace (engine/step_trace.py:
each step's device busy time) together:
- `roofline_fraction`: the schedule's roofline ideal over the best timed run (bench throughput's figure;
  with repeats=1 that is the cold run, where moe.json's figures of 811b171 divided by the warm one);
- `decode_roofline_fraction`: over the decode-only steps, their ideal (offline_steps.step_ideal_s:
  the dense weights, the experts the step's tokens touch in expectation, every context token's KV)
  over their device busy time. That is the issue's "roofline fraction of a decode step", without
  the host's gaps or the prefill steps. Both need CUDA; on CPU the runs are timed only.
"""
from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path


def _traced_run(llm, reqs) -> tuple[object, list[dict]]:
    """Run reqs once more with the schedule logged and the steps traced: (StepLog, trace lines)."""
    from pagedserve.benchmark.roofline import StepLog
    from pagedserve.benchmark.throughput import timed_generate
    from pagedserve.engine.step_trace import StepTrace
    log, sched, engine = StepLog(), llm.llm_engine.scheduler, llm.llm_engine
    original, timer = sched.schedule, engine.step_timer
    path = os.path.join(tempfile.mkdtemp(), "steps.jsonl")
    trace = StepTrace(path)

    def logged():
        out = original()
        log.record(out)
        return out
    sched.schedule, engine.step_timer = logged, trace
    try:
        timed_generate(llm, reqs)
    finally:
        sched.schedule, engine.step_timer = original, timer
    trace.flush(idle=True)
    lines = Path(path).read_text().splitlines() if os.path.exists(path) else []
    return log, [json.loads(x) for x in lines]


def decode_fraction(steps: list[dict], cost, bandwidth: float, flops_rate: float,
                    fp8_rate: float | None = None) -> dict:
    """The decode-only steps' roofline ideal over their device busy time (offline_steps' per-step ideal)."""
    from offline_steps import step_ideal_s
    decode = [s for s in steps if s["seqs"] and s["tokens"] == s["decodes"]]
    busy = sum(s["busy_ms"] for s in decode) / 1e3
    ideal = sum(step_ideal_s(s, cost, bandwidth, flops_rate, fp8_rate) for s in decode)
    return {"decode_steps": len(decode), "decode_busy_s": round(busy, 3), "decode_ideal_s": round(ideal, 3),
            "decode_mean_seqs": round(sum(s["seqs"] for s in decode) / len(decode), 1) if decode else None,
            "decode_roofline_fraction": round(ideal / busy, 3) if busy else None}


def run_workloads(model: str, workloads: list[str], engine_kwargs: dict, repeats: int = 1,
                  traced: tuple[str, ...] = ("nanovllm",), num_requests: int | None = None,
                  on_workload=None) -> dict:
    """{"results": {workload: ...}, "ratios": {workload_roofline_fraction, ...}, "switches": ...,
    "errors": {workload: message}}; the results' keys are bench throughput's, so moe_offline.py and
    its collect read them alike. on_workload(out) is called after each workload with the figures so
    far (moe_offline.py writes its file there: a device call's time limit keeps what finished); a
    workload that raises is recorded in errors and the next one runs."""
    from pagedserve import LLM
    from pagedserve.benchmark.results import engine_switches
    from pagedserve.benchmark.throughput import progress

    progress(f"loading {model} with dummy weights (one engine for {', '.join(workloads)})")
    llm = LLM(model, load_format="dummy", skip_tokenizer_init=True, **engine_kwargs)
    hf = llm.llm_engine.hf_config
    out = {"results": {}, "ratios": {}, "switches": engine_switches(llm.llm_engine.config), "errors": {}}
    for wl in workloads:
        try:
            res, wl_ratios = _one_workload(llm, hf, wl, repeats, wl in traced, num_requests, progress)
            out["results"][wl] = res
            out["ratios"].update(wl_ratios)
        except Exception as e:  # noqa: BLE001  (an OOM or a kernel error: keep the other workload's figures)
            out["errors"][wl] = f"{type(e).__name__}: {str(e)[:500]}"
            progress(f"{wl} failed: {out['errors'][wl]}")
        if on_workload is not None:
            on_workload(out)
    del llm
    return out


def _one_workload(llm, hf, wl: str, repeats: int, traced: bool, num_requests: int | None, progress):
    """(results, ratios) of one workload on the running engine: warm-up, timed runs, traced run."""
    import torch

    from pagedserve.benchmark.throughput import fitted_workload, timed_generate, warm_up_requests
    from pagedserve.workloads import VOCAB_DRAW
    ratios = {}
    reqs = fitted_workload(wl, num_requests, hf, llm.llm_engine.max_model_len)
    timed_generate(llm, warm_up_requests(reqs, vocab=getattr(hf, "vocab_size", VOCAB_DRAW)))
    runs = []
    for i in range(repeats):
        before = llm.get_kv_cache_stats().prefix_cache_hits
        r = timed_generate(llm, reqs)
        runs.append((r, llm.get_kv_cache_stats().prefix_cache_hits - before))
        progress(f"{wl} run {i + 1}/{repeats}: {r.seconds:.2f} s, {r.output_tokens_per_s:.1f} output tok/s")
    best = min((r for r, _ in runs), key=lambda r: r.seconds)
    res = {"num_requests": len(reqs), "prompt_tokens": best.prompt_tokens, "output_tokens": best.output_tokens,
           "seconds": round(best.seconds, 3), "output_tokens_per_s": round(best.output_tokens_per_s, 1),
           "total_tokens_per_s": round(best.total_tokens_per_s, 1), "requests_per_s": round(best.requests_per_s, 2),
           "runs": [{"seconds": round(r.seconds, 3), "output_tokens_per_s": round(r.output_tokens_per_s, 1),
                     "requests_per_s": round(r.requests_per_s, 2), "prefix_cache_hit_tokens": h} for r, h in runs],
           "num_gpu_blocks": llm.get_kv_cache_stats().num_blocks_total, "one_engine": True}
    if traced and torch.cuda.is_available():
        try:  # the timed figures stand without it
            ratios.update(_roofline(llm, wl, reqs, best.seconds, res, progress))
        except Exception as e:  # noqa: BLE001
            res["trace_error"] = f"{type(e).__name__}: {str(e)[:500]}"
            progress(f"{wl}: traced run failed: {res['trace_error']}")
    return res, ratios


def _roofline(llm, wl: str, reqs, best_seconds: float, res: dict, progress) -> dict:
    """The traced run's figures into res; its ratios returned."""
    from pagedserve.benchmark.hardware import measure_copy_bandwidth, measure_fp8_matmul_rate, measure_matmul_rate
    from pagedserve.benchmark.roofline import ModelCost
    ratios = {}
    progress(f"{wl}: one more run with the schedule and the step trace recorded")
    log, steps = _traced_run(llm, reqs)
    bw, rate = measure_copy_bandwidth(), measure_matmul_rate()
    cost = ModelCost.for_engine(llm.llm_engine)
    fp8 = measure_fp8_matmul_rate() if cost.fp8_matmul_params else None
    ideal = log.ideal_seconds(cost, bw, rate, fp8)
    dec = decode_fraction(steps, cost, bw, rate, fp8)
    res.update(measured_copy_bandwidth_GBps=round(bw / 1e9, 1), measured_matmul_TFLOPs=round(rate / 1e12, 1),
               roofline_ideal_seconds=round(ideal, 3), num_steps=len(log.steps), **dec)
    ratios[f"{wl}_roofline_fraction"] = round(ideal / best_seconds, 3)
    if dec["decode_roofline_fraction"] is not None:
        ratios[f"{wl}_decode_roofline_fraction"] = dec["decode_roofline_fraction"]
    return ratios
