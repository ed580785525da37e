"""What bounding free JSON whitespace (structured_outputs_max_whitespace) costs the mask fill.

For each of the serving benchmark's schemas (pagedserve/benchmark/json_schemas.serving_schemas),
a token walk is drawn once from the compact grammar (no free whitespace; each token uniform
among what the mask allows, --seed): compact JSON is valid under every whitespace setting, so
every bound then fills its masks along the very same tokens. For each bound (0 = unbounded, as
vLLM; the engine's default is STRUCTURED_OUTPUTS_MAX_WHITESPACE) the grammar comes from the
engine's own parse_spec, and one GrammarMatcher's fill_next_token_bitmask is timed at every
position of every walk, in this thread (one row; the engine spreads rows over its fill threads).
The fill is host work, so this machine's figures are the measurement, not a stand-in.

    python benchmarks/kernels/structured_whitespace_cost.py --tokenizer DIR --output OUT.json
DIR: benchmarks/serving/make_bpe_model_dir.py's 128k byte-level BPE (the serving benchmark's).
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

import torch
import xgrammar as xgr

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from pagedserve.benchmark.json_schemas import serving_schemas  # noqa: E402
from pagedserve.benchmark.results import write_result  # noqa: E402
from pagedserve.engine.structured.compiler import parse_spec  # noqa: E402
from pagedserve.sampling_params import StructuredOutputsParams  # noqa: E402


def allowed_ids(bitmask: torch.Tensor, vocab: int) -> list[int]:
    words = bitmask[0].numpy().view("uint32")
    return [i for i in range(vocab) if (words[i >> 5] >> (i & 31)) & 1]


def walk(compiler: xgr.GrammarCompiler, schema: dict, vocab: int, steps: int, rng: random.Random) -> list[int]:
    """Tokens accepted by the compact grammar, drawn uniformly from each step's mask."""
    spec = StructuredOutputsParams(json=schema, disable_any_whitespace=True)
    matcher = xgr.GrammarMatcher(compiler.compile_grammar(parse_spec(spec)))
    bitmask, tokens = xgr.allocate_token_bitmask(1, vocab), []
    while len(tokens) < steps and not matcher.is_terminated():
        matcher.fill_next_token_bitmask(bitmask)
        token = rng.choice(allowed_ids(bitmask, vocab))
        assert matcher.accept_token(token)
        tokens.append(token)
    return tokens


def fill_times(compiler: xgr.GrammarCompiler, schema: dict, tokens: list[int], vocab: int, bound: int) -> list[float]:
    matcher = xgr.GrammarMatcher(compiler.compile_grammar(parse_spec(StructuredOutputsParams(json=schema), bound)))
    bitmask, times = xgr.allocate_token_bitmask(1, vocab), []
    for token in tokens:
        t0 = time.perf_counter()
        matcher.fill_next_token_bitmask(bitmask)
        times.append(time.perf_counter() - t0)
        if not matcher.accept_token(token):  # compact JSON is valid under any whitespace bound
            raise AssertionError(f"bound {bound} refused a compact-JSON token")
    return times


def summary(times: list[float]) -> dict:
    us = sorted(t * 1e6 for t in times)
    return {"n": len(us), "p50_us": round(statistics.median(us), 1), "mean_us": round(statistics.mean(us), 1),
            "p90_us": round(us[int(0.9 * len(us))], 1), "p99_us": round(us[int(0.99 * len(us))], 1)}


def main() -> int:
    from transformers import AutoTokenizer
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokenizer", required=True, help="HF tokenizer directory (the 128k BPE)")
    ap.add_argument("--schemas", type=int, default=20, help="the first N serving schemas")
    ap.add_argument("--steps", type=int, default=60, help="tokens per walk")
    ap.add_argument("--bounds", default="0,2,4,8,20", help="max_whitespace values (0 = unbounded)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--output", default=None)
    args = ap.parse_args()
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=len(tokenizer))
    compiler = xgr.GrammarCompiler(info)
    rng = random.Random(args.seed)
    schemas = serving_schemas(50)[:args.schemas]
    walks = [walk(compiler, s, info.vocab_size, args.steps, rng) for s in schemas]
    results = {}
    for bound in (int(b) for b in args.bounds.split(",")):
        times = [t for s, w in zip(schemas, walks) for t in fill_times(compiler, s, w, info.vocab_size, bound)]
        results[f"bound_{bound}"] = summary(times)
        print(f"max_whitespace {bound}: {results[f'bound_{bound}']}", flush=True)
    base = results.get("bound_0")
    ratios = {f"{k}_mean_over_unbounded": round(v["mean_us"] / base["mean_us"], 3)
              for k, v in results.items() if base and k != "bound_0"}
    if args.output:
        config = {"tokenizer": args.tokenizer, "vocab": info.vocab_size, "schemas": args.schemas,
                  "steps": args.steps, "seed": args.seed, "walk_tokens": sum(map(len, walks)),
                  "timing": "one GrammarMatcher.fill_next_token_bitmask per position, this thread"}
        write_result(args.output, "structured_whitespace_cost", None, config, results, {}, ratios, device="cpu")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
