"""Tensor parallelism on two GPUs: does TP=2 compute what TP=1 does, and how much faster is it?

1. Agreement (bf16, greedy): a random-weight checkpoint of Qwen3-0.6B's architecture is written
   once and loaded at TP=1 and at TP=2. Per prompt, the two token streams must be equal, or at
   their first difference each engine's token must be among the other's top-5 logprobs (bf16
   all-reduces sum in a different order, so a near-tie may flip; after that the contexts
   differ and the comparison stops).
2. Throughput: `fixed256` (docs/benchmarks.md's draw) with dummy weights on Llama-3.1-8B and on
   OPT-13B, each at TP=1 and TP=2, timed by pagedserve.benchmark.throughput.run_throughput.

Every engine runs in its own process, so each gets clean GPUs. Writes
benchmarks/results/h200x2/tp.json with ratios.tp2_over_tp1_throughput (Llama-3.1-8B, total
tokens/s) and its OPT-13B twin.

    python benchmarks/tp_bench.py                       # on a host with 2 GPUs
    python benchmarks/tp_bench.py --smoke --device cpu  # the same plumbing on a tiny model, CPU
"""
from __future__ import annotations

import argparse
import json
import os
import random
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

MODELS = {"llama-3.1-8b": (ROOT / "benchmarks/models/llama-3.1-8b", 4096),
          "opt-13b": (ROOT / "benchmarks/models/opt-13b", 2048)}
AGREEMENT_ARCH = ROOT / "benchmarks/models/qwen3-0.6b"
TOP_K = 5


# ---- children: one engine each ------------------------------------------------------------------

def child_agreement(args) -> dict:
    from pagedserve import LLM, SamplingParams
    llm = LLM(args.model, dtype=args.dtype, device=args.device, tensor_parallel_size=args.tp,
              skip_tokenizer_init=True, max_model_len=args.max_model_len, seed=0)
    rng = random.Random(0)
    vocab = llm.llm_engine.vocab_size
    prompts = [{"prompt_token_ids": [rng.randrange(min(vocab, 10000)) for _ in range(rng.randint(16, 128))]}
               for _ in range(args.num_prompts)]
    sp = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True, logprobs=TOP_K)
    outs = llm.generate(prompts, sp, use_tqdm=False)
    return {"tokens": [o.outputs[0].token_ids for o in outs],
            "top": [[sorted(lp, key=lp.get, reverse=True)[:TOP_K] for lp in o.outputs[0].logprobs] for o in outs]}


def child_throughput(args) -> dict:
    from pagedserve.benchmark.throughput import run_throughput
    kwargs = {"max_model_len": args.max_model_len, "tensor_parallel_size": args.tp, "device": args.device}
    if args.dtype != "auto":
        kwargs["dtype"] = args.dtype
    return run_throughput("fixed256", args.model, kwargs, args.num_requests, repeats=2, measure_roofline=False)


def run_child(kind: str, out: Path, **kw) -> dict:
    cmd = [sys.executable, __file__, "--child", kind, "--child-out", str(out)]
    for k, v in kw.items():
        if v is not None:
            cmd += [f"--{k.replace('_', '-')}", str(v)]
    print("+", shlex.join(cmd), flush=True)
    subprocess.run(cmd, check=True, cwd=ROOT)
    return json.loads(out.read_text())


# ---- the comparison --------------------------------------------------------------------------------

def compare(a: dict, b: dict) -> dict:
    """Per prompt: identical, or at the first difference each token is in the other's top-5."""
    identical = within = 0
    first_diff = []
    for ta, tb, top_a, top_b in zip(a["tokens"], b["tokens"], a["top"], b["top"]):
        if ta == tb:
            identical += 1
            continue
        i = next(i for i, (x, y) in enumerate(zip(ta, tb)) if x != y)
        first_diff.append(i)
        if ta[i] in top_b[i] and tb[i] in top_a[i]:
            within += 1
    n = len(a["tokens"])
    return {"num_prompts": n, "identical": identical, "differ_within_top5": within,
            "differ_outside_top5": n - identical - within, "first_difference_positions": first_diff,
            "all_agree_or_within_top5": identical + within == n}


def write_random_checkpoint(arch_dir: Path, out_dir: Path, smoke: bool) -> None:
    """Random weights of the architecture in arch_dir, saved as safetensors (bf16; fp32 for the smoke run)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    d = json.loads((arch_dir / "config.json").read_text())
    if smoke:
        d.update(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, vocab_size=10240, bos_token_id=0, eos_token_id=1)
        d.pop("layer_types", None)
    cfg = AutoConfig.for_model(d.pop("model_type"), **d)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32 if smoke else torch.bfloat16)
    model.save_pretrained(out_dir, safe_serialization=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results/h200x2/tp.json"))
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default=None, help="default: bfloat16 (float32 with --smoke)")
    ap.add_argument("--num-requests", type=int, default=None, help="fixed256 subset (default: all 1000)")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--models", default="llama-3.1-8b,opt-13b")
    ap.add_argument("--smoke", action="store_true", help="tiny random model, few requests: checks the plumbing")
    ap.add_argument("--skip-agreement", action="store_true")
    ap.add_argument("--skip-throughput", action="store_true")
    # child mode
    ap.add_argument("--child", choices=["agreement", "throughput"])
    ap.add_argument("--child-out")
    ap.add_argument("--model")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--max-model-len", type=int, default=4096)
    args = ap.parse_args()
    args.dtype = args.dtype or ("float32" if args.smoke else "bfloat16")

    if args.child:
        result = child_agreement(args) if args.child == "agreement" else child_throughput(args)
        Path(args.child_out).write_text(json.dumps(result))
        return

    from pagedserve.benchmark.results import git_commit, write_result
    git_commit()  # refuse before measuring, not after
    tmp = Path(tempfile.mkdtemp(prefix="tp_bench_"))
    common = dict(device=args.device, dtype=args.dtype)
    results, ratios, config = {}, {}, {"dtype": args.dtype, "device": args.device, "smoke": args.smoke}

    if not args.skip_agreement:
        ckpt = tmp / "agreement-ckpt"
        write_random_checkpoint(AGREEMENT_ARCH, ckpt, args.smoke)
        runs = {tp: run_child("agreement", tmp / f"agree{tp}.json", model=ckpt, tp=tp, max_model_len=1024,
                              num_prompts=args.num_prompts, max_tokens=args.max_tokens, **common) for tp in (1, 2)}
        results["agreement"] = {"model_arch": str(AGREEMENT_ARCH.relative_to(ROOT)), "random_weights": True,
                                "max_tokens": args.max_tokens, **compare(runs[1], runs[2])}
        ratios["greedy_identical_fraction"] = round(results["agreement"]["identical"] / args.num_prompts, 3)
        config["agreement"] = {"num_prompts": args.num_prompts, "max_tokens": args.max_tokens, "top_k": TOP_K}

    if not args.skip_throughput:
        num_requests = args.num_requests or (4 if args.smoke else None)
        for name in args.models.split(","):
            model_dir, max_len = MODELS[name]
            if args.smoke:
                model_dir, max_len = tmp / "agreement-ckpt", 1024
            per_tp = {tp: run_child("throughput", tmp / f"{name}-tp{tp}.json", model=model_dir, tp=tp,
                                    max_model_len=max_len, num_requests=num_requests, **common)["results"]
                      for tp in (1, 2)}
            results[f"fixed256_{name}"] = {f"tp{tp}": r for tp, r in per_tp.items()}
            ratio = round(per_tp[2]["total_tokens_per_s"] / per_tp[1]["total_tokens_per_s"], 3)
            ratios["tp2_over_tp1_throughput" if name == "llama-3.1-8b" else f"tp2_over_tp1_throughput_{name}"] = ratio
        config["throughput"] = {"workload": "fixed256", "models": args.models.split(","),
                                "num_requests": num_requests or 1000, "load_format": "dummy"}

    doc = write_result(args.out, "tp", "python benchmarks/tp_bench.py " + shlex.join(sys.argv[1:]), config,
                       results, {}, ratios)
    print(json.dumps(doc["ratios"], indent=2))
    if "agreement" in results and not results["agreement"]["all_agree_or_within_top5"]:
        print("TP=2 and TP=1 disagree beyond a near-tie: see results.agreement", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
