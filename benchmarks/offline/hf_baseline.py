"""HF transformers on the same requests, the two ways a user without a serving engine runs it.

`generate`: one left-padded batch, its default cache. `generate_batch`: transformers' own
continuous batching with a paged cache. Both take one max_new_tokens for all requests, so
every request gets the workload's mean output length and the total work matches
(docs/benchmarks.md). Dummy (random) weights in bf16; sampling at temperature 0.6.
--output writes the result through pagedserve.benchmark.results (device, commit, versions).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from pagedserve.benchmark.results import git_commit, write_result  # noqa: E402
from pagedserve.workloads import make_workload  # noqa: E402


def load(model_dir: str):
    cfg = AutoConfig.from_pretrained(model_dir)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(cfg, torch_dtype=torch.bfloat16, attn_implementation="sdpa")
    return model.eval()


def gen_config(max_new_tokens: int) -> GenerationConfig:
    # min_new_tokens == max_new_tokens plays the part of ignore_eos.
    return GenerationConfig(max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens, do_sample=True,
                            temperature=0.6, top_k=0, top_p=1.0, pad_token_id=0, eos_token_id=1)


def run_generate(model, prompts: list[list[int]], max_new: int, batch_size: int) -> tuple[float, int]:
    t0 = time.perf_counter()
    produced = 0
    for i in range(0, len(prompts), batch_size):
        chunk = prompts[i:i + batch_size]
        width = max(map(len, chunk))
        ids = torch.zeros(len(chunk), width, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for j, p in enumerate(chunk):  # left padding
            ids[j, width - len(p):] = torch.tensor(p)
            mask[j, width - len(p):] = 1
        with torch.no_grad():
            out = model.generate(input_ids=ids.cuda(), attention_mask=mask.cuda(), generation_config=gen_config(max_new))
        produced += (out.shape[1] - width) * len(chunk)
    torch.cuda.synchronize()
    return time.perf_counter() - t0, produced


def run_generate_batch(model, prompts: list[list[int]], max_new: int) -> tuple[float, int]:
    t0 = time.perf_counter()
    with torch.no_grad():
        outs = model.generate_batch(inputs=prompts, generation_config=gen_config(max_new))
    torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    produced = sum(len(o.generated_tokens) for o in outs.values())
    return dt, produced


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--workload", default="nanovllm")
    ap.add_argument("--model", default="benchmarks/models/qwen3-0.6b")
    ap.add_argument("--num-requests", type=int, default=None, help="subset of the workload (first N)")
    ap.add_argument("--max-new-tokens", type=int, default=None, help="default: the workload's mean output")
    ap.add_argument("--batch-size", type=int, default=256)
    ap.add_argument("--modes", default="generate,generate_batch")
    ap.add_argument("--output", default=None)
    args = ap.parse_args()
    if args.output:
        git_commit()  # refuse before measuring, not after
    reqs = make_workload(args.workload)
    mean_out = round(statistics.mean(r.output_len for r in reqs))
    reqs = reqs[:args.num_requests] if args.num_requests else reqs
    max_new = args.max_new_tokens or mean_out
    prompts = [r.prompt_token_ids for r in reqs]
    model = load(args.model)
    config = {"model": args.model, "workload": args.workload, "num_requests": len(prompts),
              "workload_num_requests": len(make_workload(args.workload)), "max_new_tokens": max_new,
              "workload_mean_output": mean_out, "batch_size": args.batch_size, "load_format": "dummy",
              "dtype": "bfloat16", "temperature": 0.6}
    report: dict = {}
    for mode in args.modes.split(","):
        try:
            if mode == "generate":
                run_generate(model, prompts[:2], 4, 2)  # warm-up
                dt, produced = run_generate(model, prompts, max_new, args.batch_size)
            else:
                run_generate_batch(model, prompts[:2], 4)
                dt, produced = run_generate_batch(model, prompts, max_new)
            report[mode] = {"seconds": round(dt, 3), "output_tokens": produced,
                            "output_tokens_per_s": round(produced / dt, 1),
                            "requests_per_s": round(len(prompts) / dt, 3)}
        except Exception as e:  # one failing path must not lose the other's figure
            report[mode] = {"error": f"{type(e).__name__}: {e}"[:500]}
        print(json.dumps({mode: report[mode]}), flush=True)
    if args.output:
        write_result(args.output, f"hf_{args.workload}", None, config, report)


if __name__ == "__main__":
    main()
