#!/usr/bin/env python3
"""One decode step of vLLM and of pagedserve, measured the same way through their public `LLM`.

Issue #13's TPOT gap at 10 and 20 req/s lives in small-batch decode steps. This script measures
such a step in either engine without reaching into it: N prompts of P random token ids (prefix
caching off, greedy, ignore_eos) are generated twice, once for --short and once for --long new
tokens. Both runs do the same prefill, so their difference is (long - short) decode steps of N
sequences:

  step period    (median wall of the long runs - median wall of the short runs) / (long - short)
  kernels/step   from torch.profiler over one short and one long run, differenced per kernel name
  GPU busy/step  the same difference of summed kernel time; period - busy is what the GPU waited

With CUDA graphs (both engines' default) the profiler still sees every replayed kernel.

  # vLLM 0.26 installed into $SITE (benchmarks/peers/README, vs_vllm.py):
  VLLM_ENABLE_V1_MULTIPROCESSING=0 PYTHONPATH=$SITE python3 benchmarks/serving/peers/decode_step_diff.py \\
      --engine vllm --num-seqs 16 --out $OUT/decode_vllm_n16.json
  python3 benchmarks/serving/peers/decode_step_diff.py --engine pagedserve --num-seqs 16 --out $OUT/decode_ps_n16.json

Several --num-seqs share one engine (one start-up); --out then names a file per batch size
through "{n}". --pagedserve-kwargs passes LLM(...) arguments to pagedserve only, for an A/B of
one engine switch (e.g. '{"cuda_graph_sizes": [1, 2, 4, 8, 16, 32, 48, 64]}').

vLLM must run its engine core in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0) for the profiler
to see its kernels; the script refuses otherwise. On CPU (--device cpu, pagedserve only) it
measures wall time alone: the plumbing, for tests.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]

for k, v in {"VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1", "HF_HUB_OFFLINE": "1",
             "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}.items():
    os.environ.setdefault(k, v)


def make_llm(args):
    """(llm, SamplingParams class, engine facts) through the engine's own public API."""
    model_dir = tempfile.mkdtemp(prefix="decode_step_diff_")
    shutil.copy(args.config, os.path.join(model_dir, "config.json"))
    common = dict(model=model_dir, load_format="dummy", skip_tokenizer_init=True, dtype=args.dtype,
                  max_model_len=args.max_model_len, enable_prefix_caching=False, seed=0,
                  gpu_memory_utilization=0.9)
    if args.engine == "vllm":
        if os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") != "0":
            raise SystemExit("set VLLM_ENABLE_V1_MULTIPROCESSING=0: the profiler sees only this process's kernels")
        import vllm
        from vllm import LLM, SamplingParams
        return LLM(**common, attention_backend="FLASH_ATTN"), SamplingParams, {"vllm_version": vllm.__version__}
    sys.path.insert(0, str(ROOT))
    from pagedserve import LLM, SamplingParams
    extra = json.loads(args.pagedserve_kwargs) if args.pagedserve_kwargs else {}
    return LLM(**common, device=args.device, **extra), SamplingParams, {"pagedserve_kwargs": extra}


def kernel_totals(prof) -> dict[str, list[float]]:
    """name -> [calls, microseconds] of device kernels (copies, memsets and c10d ranges left out)."""
    import torch
    out: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA and not e.name.startswith(("Memcpy", "Memset", "nccl:")):
            out[e.name][0] += 1
            out[e.name][1] += e.time_range.elapsed_us()
    return out


def measure(llm, SamplingParams, args, num_seqs: int) -> dict:
    """Step period (and, on CUDA, kernels per step) of num_seqs sequences decoding together."""
    rng = random.Random(num_seqs)
    prompts = [{"prompt_token_ids": [rng.randrange(0, args.token_id_limit) for _ in range(args.prompt_len)]}
               for _ in range(num_seqs)]

    def run(max_tokens: int) -> float:
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0)
        t = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        secs = time.perf_counter() - t
        got = [len(o.outputs[0].token_ids) for o in outs]
        if got != [max_tokens] * len(prompts):
            raise RuntimeError(f"expected {max_tokens} tokens for every prompt, got {sorted(set(got))}")
        return secs

    run(args.long)  # warm-up: compiles, graph capture, allocator
    walls = {n: statistics.median(run(n) for _ in range(args.repeat)) for n in (args.short, args.long)}
    steps = args.long - args.short
    result: dict = {"step_period_ms": round((walls[args.long] - walls[args.short]) / steps * 1e3, 4),
                    "wall_s": {str(k): round(v, 4) for k, v in walls.items()}}
    if args.device == "cuda":
        import torch
        from torch.profiler import ProfilerActivity, profile
        totals = {}
        for n in (args.short, args.long):
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                run(n)
                torch.cuda.synchronize()
            totals[n] = kernel_totals(prof)
        per_step = {}
        for name in set(totals[args.short]) | set(totals[args.long]):
            a, b = totals[args.short].get(name, [0, 0.0]), totals[args.long].get(name, [0, 0.0])
            calls, us = (b[0] - a[0]) / steps, (b[1] - a[1]) / steps
            if calls > 0.5:  # kernels of decode steps (prefill-only ones difference to ~0)
                per_step[name] = (calls, us)
        busy_us = sum(us for _, us in per_step.values())
        result.update({
            "kernels_per_step": round(sum(c for c, _ in per_step.values()), 1),
            "gpu_busy_ms_per_step": round(busy_us / 1e3, 4),
            "gpu_waiting_ms_per_step": round(result["step_period_ms"] - busy_us / 1e3, 4),
            "top_kernels": [{"name": k[:200], "calls_per_step": round(c, 2), "us_per_step": round(us, 2),
                             "share": round(us / busy_us, 4) if busy_us else None}
                            for k, (c, us) in sorted(per_step.items(), key=lambda kv: -kv[1][1])[:args.top]],
            "device": torch.cuda.get_device_name(0), "torch": torch.__version__})
    return result


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engine", choices=["vllm", "pagedserve"], required=True)
    ap.add_argument("--config", default=str(ROOT / "benchmarks/models/llama-3.1-8b/config.json"))
    ap.add_argument("--num-seqs", type=int, nargs="+", default=[16], help="batch sizes, one engine for all")
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--short", type=int, default=8, help="new tokens of the short runs")
    ap.add_argument("--long", type=int, default=72, help="new tokens of the long runs")
    ap.add_argument("--repeat", type=int, default=3, help="timed runs of each length")
    ap.add_argument("--token-id-limit", type=int, default=10000, help="prompt ids uniform in [0, this)")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--device", default="cuda", help="pagedserve only: cpu runs the plumbing, wall time alone")
    ap.add_argument("--pagedserve-kwargs", default=None, help="JSON object of extra LLM(...) arguments (pagedserve)")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--out", default=None, help='JSON file; with several --num-seqs it must hold "{n}"')
    args = ap.parse_args()
    if args.long <= args.short:
        ap.error("--long must exceed --short")
    if args.engine == "vllm" and args.device != "cuda":
        ap.error("--engine vllm runs on cuda only")
    if args.engine == "vllm" and args.pagedserve_kwargs:
        ap.error("--pagedserve-kwargs is for --engine pagedserve")
    if args.out and len(args.num_seqs) > 1 and "{n}" not in args.out:
        ap.error('--out must hold "{n}" with several --num-seqs')

    t0 = time.perf_counter()
    llm, SamplingParams, facts = make_llm(args)
    init_s = round(time.perf_counter() - t0, 1)
    # This project's commit, for either engine: the script is ours (a copy without .git reads
    # pagedserve/_build_commit.json).
    sys.path.insert(0, str(ROOT))
    from pagedserve.benchmark.results import ENV_SWITCHES, git_commit
    commit = git_commit()
    for n in args.num_seqs:
        result = {**measure(llm, SamplingParams, args, n), "init_s": init_s}
        config = {k: getattr(args, k) for k in ("config", "prompt_len", "short", "long", "repeat",
                                                "dtype", "max_model_len", "device", "token_id_limit")}
        doc = {"benchmark": "decode_step_diff", "engine": args.engine, **facts,
               "date": time.strftime("%Y-%m-%d"), "command": " ".join([sys.executable] + sys.argv),
               "config": {**config, "num_seqs": n},
               "env": {k: os.environ.get(k) for k in ("VLLM_ENABLE_V1_MULTIPROCESSING", *ENV_SWITCHES)},
               "results": result, "commit": commit}
        print(json.dumps({"num_seqs": n, **{k: v for k, v in result.items() if k != "top_kernels"}}), flush=True)
        if args.out:
            path = Path(args.out.replace("{n}", str(n)))
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(doc, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
