"""Latency of one mixed step (decodes plus one prompt), piecewise CUDA graphs against eager.

Builds a ModelRunner on CUDA with dummy weights (default: Llama-3.1-8B's config), captures the
decode and piecewise graphs as the engine does at start-up, then runs steps of --decodes decode
tokens (context --context each) plus one prompt of P tokens for every P in --prompt-lens, first
through the piecewise graphs and then eagerly (the runner's piecewise graphs set aside). Each
step is timed with the wall clock from launch to a device synchronize: the latency an inter-token
gap sees when a new request's prompt joins the batch. Prints one JSON object; needs CUDA.

  python benchmarks/mixed_step.py
  python benchmarks/mixed_step.py --model benchmarks/models/qwen3-0.6b --prompt-lens 32 128 512
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from pagedserve.config import EngineConfig  # noqa: E402
from pagedserve.models.loader import load_hf_config  # noqa: E402
from pagedserve.runner.batch import HostBatch  # noqa: E402
from pagedserve.runner.model_runner import ModelRunner, StepInput  # noqa: E402


def mixed_batch(decodes: int, context: int, prompt_len: int, block_size: int, vocab: int) -> HostBatch:
    """decodes sequences at position context - 1, then one prompt from position 0; disjoint blocks."""
    rng = np.random.default_rng(0)
    per_decode = -(-context // block_size)
    tables = [list(range(i * per_decode, (i + 1) * per_decode)) for i in range(decodes)]
    first = decodes * per_decode
    tables.append(list(range(first, first + -(-prompt_len // block_size))))
    return HostBatch(input_ids=rng.integers(0, vocab, decodes + prompt_len),
                     starts=np.array([context - 1] * decodes + [0], dtype=np.int64),
                     query_lens=np.array([1] * decodes + [prompt_len], dtype=np.int64),
                     block_tables=tables, sample_mask=np.ones(decodes + 1, dtype=bool), num_decodes=decodes)


def step_ms(runner: ModelRunner, batch: HostBatch, steps: int) -> float:
    step = StepInput([], [], [], batch)
    for _ in range(3):
        runner.execute_model(step)
    torch.cuda.synchronize()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        runner.execute_model(step)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return round(1e3 * statistics.median(times), 3)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=str(ROOT / "benchmarks/models/llama-3.1-8b"))
    ap.add_argument("--decodes", type=int, default=100)
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--prompt-lens", type=int, nargs="+", default=[64, 200, 400, 900])
    ap.add_argument("--steps", type=int, default=20)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("mixed_step.py needs CUDA")
    cfg = EngineConfig(model=args.model, load_format="dummy", swap_space=0, max_model_len=4096,
                       max_num_seqs=max(128, args.decodes + 1))
    runner = ModelRunner(cfg, load_hf_config(args.model), torch.device("cuda"), torch.bfloat16)
    runner.load_model()
    bs = runner.block_size
    num_blocks = (args.decodes + 1) * -(-max(args.context, max(args.prompt_lens)) // bs) + 8
    t0 = time.perf_counter()
    runner.init_kv_cache(num_blocks, 0)
    capture_s = time.perf_counter() - t0
    pw = runner.piecewise
    if pw is None:
        sys.exit("no piecewise graphs were captured (model family or cudagraph_mode)")
    rows = []
    for p in args.prompt_lens:
        batch = mixed_batch(args.decodes, args.context, p, bs, runner.vocab_size)
        runner.piecewise = pw
        piecewise = step_ms(runner, batch, args.steps) if pw.bucket_for(args.decodes + p) else None
        runner.piecewise = None
        eager = step_ms(runner, batch, args.steps)
        rows.append({"prompt_len": p, "tokens": args.decodes + p, "bucket": pw.bucket_for(args.decodes + p),
                     "piecewise_ms": piecewise, "eager_ms": eager})
    print(json.dumps({"model": args.model, "decodes": args.decodes, "context": args.context,
                      "graphs": pw.num_graphs, "buckets": len(pw.buckets),
                      "decode_and_piecewise_capture_s": round(capture_s, 2), "steps": rows}, indent=1))


if __name__ == "__main__":
    main()
