#!/usr/bin/env python3
"""Offline vLLM peer benchmark for the GPU machine (vLLM 0.26.0 installed into $SITE).

Run from the project root on the GPU machine (configs from benchmarks/models/, or --config):
    PYTHONPATH=$SITE VLLM_USE_FLASHINFER_SAMPLER=0 python3 benchmarks/serving/peers/bench_vllm.py --workload nanovllm --repeat 2
    PYTHONPATH=$SITE VLLM_USE_FLASHINFER_SAMPLER=0 python3 benchmarks/serving/peers/bench_vllm.py --workload fixed256 --repeat 2

Workloads (docs/benchmarks.md; random token ids, ignore_eos, dummy weights, bf16):
  nanovllm  Qwen3-0.6B, 256 requests, prompt and output lengths uniform in [100, 1024]
  fixed256  Llama-3.1-8B, 1000 requests, 256 prompt tokens, 256 output tokens
  trtllm_128_128, trtllm_128_2048  Llama-3.1-8B at TensorRT-LLM's published FP8 shapes (8000 / 1000
            requests), ids as benchmarks/offline/fp8_bench.py draws them
Draw rule, random.Random(0): all prompt lengths, then all output lengths (nanovllm only),
then token ids uniform in [0, 10000), request by request.
Writes vllm_[<tag>_]<workload>.json into $OUT when that is set (and --out PATH if given).
--also W...: more workloads of the same model on the same LLM (one start-up). FP8 as ours runs it:
    ... --workload fixed256 --also trtllm_128_128 --quantization fp8 --kv-cache-dtype fp8 --tag fp8
MoE beside benchmarks/offline/moe_offline.py --vllm-dir:
    ... --workload nanovllm --also fixed256 --config benchmarks/models/qwen3-30b-a3b/config.json --tag qwen3-30b-a3b
"""
import argparse
import json
import os
import random
import shutil
import sys
import tempfile
import time

# No network there: keep vLLM / HF from trying to reach anything.
for k, v in {"VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1", "HF_HUB_OFFLINE": "1",
             "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}.items():
    os.environ.setdefault(k, v)

WORKLOADS = {
    "nanovllm": {"config": "benchmarks/models/qwen3-0.6b/config.json", "num_requests": 256,
                 "prompt_len": (100, 1024), "output_len": (100, 1024)},
    "fixed256": {"config": "benchmarks/models/llama-3.1-8b/config.json", "num_requests": 1000,
                 "prompt_len": 256, "output_len": 256},
    # TensorRT-LLM's published FP8 shapes (benchmarks/offline/fp8_bench.py draws the same ids:
    # random.Random(0), request by request).
    "trtllm_128_128": {"config": "benchmarks/models/llama-3.1-8b/config.json", "num_requests": 8000,
                       "prompt_len": 128, "output_len": 128, "ids_only": True},
    "trtllm_128_2048": {"config": "benchmarks/models/llama-3.1-8b/config.json", "num_requests": 1000,
                        "prompt_len": 128, "output_len": 2048, "ids_only": True},
}


def make_requests(name):
    w = WORKLOADS[name]
    rng = random.Random(0)
    n = w["num_requests"]
    if w.get("ids_only"):  # fixed lengths, ids drawn request by request
        return ([[rng.randrange(0, 10000) for _ in range(w["prompt_len"])] for _ in range(n)],
                [w["output_len"]] * n)

    def lengths(spec):
        if isinstance(spec, tuple):
            return [rng.randint(spec[0], spec[1]) for _ in range(n)]
        return [spec] * n

    prompt_lens = lengths(w["prompt_len"])
    output_lens = lengths(w["output_len"])
    prompts = [[rng.randrange(0, 10000) for _ in range(pl)] for pl in prompt_lens]
    return prompts, output_lens


def find_repo_root(explicit):
    if explicit:
        return os.path.abspath(explicit)
    for start in (os.getcwd(), os.path.dirname(os.path.abspath(__file__))):
        d = start
        while True:
            if os.path.isdir(os.path.join(d, "benchmarks", "models")):
                return d
            parent = os.path.dirname(d)
            if parent == d:
                break
            d = parent
    return os.getcwd()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workload", choices=sorted(WORKLOADS), default="nanovllm")
    ap.add_argument("--also", nargs="*", default=[], choices=sorted(WORKLOADS),
                    help="further workloads of the same model run on the same LLM (one start-up); each "
                         "writes its own vllm_<workload>.json")
    ap.add_argument("--quantization", default=None, help="e.g. fp8 (recorded in config)")
    ap.add_argument("--kv-cache-dtype", default=None, help="e.g. fp8 (recorded in config)")
    ap.add_argument("--tag", default="", help="output files are vllm_<tag>_<workload>.json, e.g. --tag fp8, "
                    "or --tag qwen3-30b-a3b (the names benchmarks/offline/moe_offline.py --vllm-dir reads)")
    ap.add_argument("--repo-root", default=None, help="dir holding benchmarks/models (default: cwd or above)")
    ap.add_argument("--config", default=None, help="an HF config.json to use instead of the workload's")
    ap.add_argument("--repeat", type=int, default=1, help="timed generate() runs; reports each and the median")
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--enforce-eager", action="store_true", help="debug only: no torch.compile / CUDA graphs")
    ap.add_argument("--out", default=None, help="also write the JSON here")
    ap.add_argument("--dry-run", action="store_true", help="draw the workload and print its stats; no vLLM")
    args = ap.parse_args()

    w = WORKLOADS[args.workload]
    names = [args.workload, *args.also]
    if args.dry_run:
        for name in names:
            prompts, output_lens = make_requests(name)
            print(json.dumps({"workload": name, "requests": len(prompts),
                              "prompt_tokens": sum(map(len, prompts)), "output_tokens": sum(output_lens),
                              "first_prompt_len": len(prompts[0]), "first_output_len": output_lens[0],
                              "first_ids": prompts[0][:5]}))
        return
    if any(WORKLOADS[n]["config"] != w["config"] for n in args.also) and not args.config:
        raise SystemExit("--also: every workload must use the same model config")

    import vllm
    from vllm import LLM, SamplingParams

    root = find_repo_root(args.repo_root)
    src_cfg = args.config or os.path.join(root, w["config"])
    model_dir = tempfile.mkdtemp(prefix=f"vllm_{args.workload}_")
    shutil.copy(src_cfg, os.path.join(model_dir, "config.json"))

    llm_kwargs = dict(model=model_dir, load_format="dummy", skip_tokenizer_init=True, dtype="bfloat16",
                      max_model_len=args.max_model_len, gpu_memory_utilization=args.gpu_memory_utilization,
                      attention_backend="FLASH_ATTN", seed=0)
    if args.quantization:
        llm_kwargs["quantization"] = args.quantization
    if args.kv_cache_dtype:
        llm_kwargs["kv_cache_dtype"] = args.kv_cache_dtype
    if args.enforce_eager:
        llm_kwargs["enforce_eager"] = True
    t0 = time.perf_counter()
    llm = LLM(**llm_kwargs)
    init_s = time.perf_counter() - t0

    # Warm-up: 2 short requests (ids from their own RNG, so the workload draw is untouched).
    wrng = random.Random(1)
    warm = [{"prompt_token_ids": [wrng.randrange(0, 10000) for _ in range(32)]} for _ in range(2)]
    llm.generate(warm, SamplingParams(max_tokens=16, ignore_eos=True, temperature=0.6), use_tqdm=False)
    for name in names:
        run_workload(args, name, llm, llm_kwargs, init_s, vllm.__version__, SamplingParams)
    shutil.rmtree(model_dir, ignore_errors=True)


def run_workload(args, name, llm, llm_kwargs, init_s, vllm_version, SamplingParams):
    w = WORKLOADS[name]
    prompts, output_lens = make_requests(name)
    n_prompt = sum(len(p) for p in prompts)
    n_out_expected = sum(output_lens)
    inputs = [{"prompt_token_ids": p} for p in prompts]
    params = [SamplingParams(max_tokens=o, ignore_eos=True, temperature=0.6) for o in output_lens]
    runs = []
    for _ in range(max(1, args.repeat)):
        t = time.perf_counter()
        outs = llm.generate(inputs, params, use_tqdm=False)
        secs = time.perf_counter() - t
        n_out = sum(len(o.outputs[0].token_ids) for o in outs)
        runs.append({"seconds": round(secs, 4), "output_tokens": n_out,
                     "output_tok_s": round(n_out / secs, 2),
                     "req_s": round(len(outs) / secs, 3),
                     "total_tok_s": round((n_prompt + n_out) / secs, 2)})
    med = sorted(runs, key=lambda r: r["seconds"])[(len(runs) - 1) // 2]

    try:
        import torch
        device = torch.cuda.get_device_name(0)
        torch_v = torch.__version__
    except Exception as e:  # pragma: no cover
        device, torch_v = f"unknown ({e})", "unknown"

    res = {"benchmark": name, "engine": "vllm", "vllm_version": vllm_version,
           "torch_version": torch_v, "device": device,
           "date": time.strftime("%Y-%m-%d"), "command": " ".join([sys.executable] + sys.argv),
           "config": {"model_config": args.config or w["config"], "requests": len(prompts), "prompt_tokens": n_prompt,
                      "expected_output_tokens": n_out_expected, "temperature": 0.6, "ignore_eos": True,
                      **{k: v for k, v in llm_kwargs.items() if k != "model"}},
           "results": {"total_output_tokens": med["output_tokens"], "seconds": med["seconds"],
                       "output_tok_s": med["output_tok_s"], "init_seconds": round(init_s, 2),
                       "req_s": med["req_s"], "total_tok_s": med["total_tok_s"], "runs": runs}}
    if med["output_tokens"] != n_out_expected:
        res["warning"] = f"output tokens {med['output_tokens']} != expected {n_out_expected}"

    text = json.dumps(res, indent=2)
    print(text)
    paths = [args.out] if args.out and name == args.workload else []
    if os.environ.get("OUT"):
        paths.append(os.path.join(os.environ["OUT"], f"vllm_{args.tag + '_' if args.tag else ''}{name}.json"))
    for p in paths:
        os.makedirs(os.path.dirname(os.path.abspath(p)), exist_ok=True)
        with open(p, "w") as f:
            f.write(text + "\n")

if __name__ == "__main__":
    main()
