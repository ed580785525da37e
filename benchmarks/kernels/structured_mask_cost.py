"""What a constrained request costs the host per step, and what a grammar costs to compile.

The engine's own pieces (engine/structured/): StructuredOutputs compiles the 50 benchmark schemas
(pagedserve/benchmark/json_schemas.py) on its pool, then --batch sequences decode side by side for
--steps steps, each step as the engine does it: every matcher catches up on its newest token
(accept), the host bitmask rows are filled (fill), and the mask is applied to a [batch, vocab]
logits tensor on --device (upload + apply, synchronized on CUDA). The tokens are drawn uniformly
from what each mask allows, so the walk visits strings, numbers, keys and closing brackets alike;
a sequence whose grammar closes starts over.

Reported (JSON on stdout, and to --output): compile seconds p50 / p99, uncached (first compile of
each schema) and cached (the same spec again: the engine's cache hit); per sequence and step,
microseconds of accept and of fill (p50, p99, mean), and per step the apply time for the batch.
Fill is the part that grows with the vocabulary: pass --tokenizer with a real model's tokenizer
directory (a 128k-token vocabulary costs more than the demo model's 2048).

  python benchmarks/kernels/structured_mask_cost.py                       # demo tokenizer, CPU
  python benchmarks/kernels/structured_mask_cost.py --tokenizer DIR --device cuda --batch 64 --output $OUT/mask.json
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import time

import torch
import xgrammar as xgr

from pagedserve.benchmark.json_schemas import benchmark_schemas
from pagedserve.demo_model import DEMO_MODEL_DIR
from pagedserve.engine.input_processor import load_tokenizer
from pagedserve.engine.structured import StructuredOutputs
from pagedserve.sampling_params import StructuredOutputsParams


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def _summary(xs: list[float], scale: float) -> dict:
    return {"p50": round(_pct(xs, 0.5) * scale, 3), "p99": round(_pct(xs, 0.99) * scale, 3),
            "mean": round(statistics.fmean(xs) * scale, 3)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokenizer", default=str(DEMO_MODEL_DIR), help="HF tokenizer directory")
    p.add_argument("--vocab-size", type=int, default=None, help="the model's (padded) vocab; default len(tokenizer)")
    p.add_argument("--batch", type=int, default=32, help="constrained sequences decoding side by side")
    p.add_argument("--steps", type=int, default=64)
    p.add_argument("--device", default="cpu")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output", default=None)
    args = p.parse_args()

    tok = load_tokenizer(args.tokenizer)
    vocab = args.vocab_size or len(tok)
    device = torch.device(args.device)
    so = StructuredOutputs(tok, vocab, {tok.eos_token_id}, device)
    specs = [StructuredOutputsParams(json=s) for s in benchmark_schemas()]

    uncached, cached, compiled = [], [], []
    for spec in specs:
        for times in (uncached, cached):
            t0 = time.perf_counter()
            compiled.append(so.pool.submit(spec.key(), so.check(spec)).result())
            times.append(time.perf_counter() - t0)
    compiled = compiled[::2]

    rng = random.Random(args.seed)
    seqs = []  # [grammar index, SeqGrammar, output tokens]

    def fresh(i):
        k = i % len(compiled)
        seqs[i] = [k, so.seqs.start(i, compiled[k]), []]
    seqs = [None] * args.batch
    for i in range(args.batch):
        fresh(i)
    accept_s, fill_s, apply_s, restarts = [], [], [], 0
    logits = torch.zeros(args.batch, vocab, device=device, dtype=torch.bfloat16 if device.type == "cuda" else torch.float32)
    words = xgr.get_bitmask_shape(1, vocab)[1]
    bits = torch.arange(32, dtype=torch.int32)
    for _ in range(args.steps):
        t0 = time.perf_counter()
        filled = so.fill([(i, s[1]) for i, s in enumerate(seqs)])
        fill_s.append((time.perf_counter() - t0) / args.batch)
        t0 = time.perf_counter()
        so.apply(logits, filled)
        if device.type == "cuda":
            torch.cuda.synchronize()
        apply_s.append(time.perf_counter() - t0)
        bitmask = filled[0] if filled else torch.full((args.batch, words), -1, dtype=torch.int32)
        allowed = ((bitmask[:args.batch, :, None] >> bits) & 1).reshape(args.batch, -1)[:, :vocab]
        t0 = time.perf_counter()
        for i, s in enumerate(seqs):
            ids = allowed[i].nonzero().flatten().tolist()
            s[2].append(rng.choice(ids))
        pick_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        for s in seqs:
            s[1].catch_up(s[2])
        accept_s.append((time.perf_counter() - t0) / args.batch)
        del pick_s
        for i, s in enumerate(seqs):
            if s[1].done:
                restarts += 1
                so.seqs.free(i)
                fresh(i)
    result = {
        "tokenizer": args.tokenizer, "vocab_size": vocab, "batch": args.batch, "steps": args.steps,
        "device": str(device), "schemas": len(specs), "grammars_closed_and_restarted": restarts,
        "compile_ms_uncached": _summary(uncached, 1e3), "compile_ms_cached": _summary(cached, 1e3),
        "accept_us_per_seq_step": _summary(accept_s, 1e6), "fill_us_per_seq_step": _summary(fill_s, 1e6),
        "apply_us_per_step_for_batch": _summary(apply_s, 1e6),
    }
    so.shutdown()
    text = json.dumps(result, indent=1)
    print(text)
    if args.output:
        with open(args.output, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
