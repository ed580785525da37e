"""What both engines' sections share: the model config, the prompts, the lengths, the progress log."""
from __future__ import annotations

import os
import random
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
MODEL = str(ROOT / "benchmarks/models/llama-3.1-8b")
PROMPT_LEN, OUTPUT_LEN = 128, 128
BATCHES = (1, 8, 32, 128)
KS = (1, 2, 4)
ACCEPTS = (0.0, 0.5, 0.8, 1.0)
FIXED = 1 << 30            # spec_disable_batch_tokens that never turns speculation off
ADAPTIVE_K = 4
GRIDS = ("full", "quick")  # ours.spec_plan
PARTS = ROOT / "benchmarks/results/h200/spec_decode_parts"
OUTPUT = ROOT / "benchmarks/results/h200/spec_decode.json"
# max_tokens of the untimed warm-up generate before each (configuration, batch)'s timed ones: the same
# batch as the timed generates, so lazy first-call work at that shape (vLLM's first generate of a
# draft config at batch 1 took 1.2 s for 2 tokens) lands here, not in t2 or t.
WARMUP_TOKENS = 2


def make_prompts(batch: int, prompt_len: int, vocab: int, seed: int = 0) -> list[list[int]]:
    """`batch` copy-heavy prompts: a random passage of prompt_len // 2 ids (from [10, 10000), the
    workloads' draw, within the vocabulary), written twice."""
    rng = random.Random(seed * 1000 + batch)
    half = prompt_len // 2
    out = []
    for _ in range(batch):
        passage = [rng.randrange(10, min(10000, vocab)) for _ in range(half)]
        out.append((passage * 3)[:prompt_len])
    return out


def log(msg: str) -> None:
    line = f"[{time.strftime('%H:%M:%S')}] {msg}"
    print(line, flush=True)
    out = os.environ.get("OUT")
    if out:
        with open(Path(out) / "spec_progress.log", "a") as f:
            f.write(line + "\n")


def sync() -> None:
    import torch
    if torch.cuda.is_available():
        torch.cuda.synchronize()


SAMPLE_IDS = 16  # how many output ids of a batch's first request a part keeps


def timing(t: float, t2: float, warmup: float, outs: list[list[int]], output_len: int) -> dict:
    """One batch's figures from its generates' seconds (t the full one, t2 the max_tokens=2 one, warmup
    the untimed warm-up: kept beside them, a warm-up far above t2 shows lazy work it absorbed) and the
    full generate's output ids. sample_output_ids, the first request's first SAMPLE_IDS ids, show what
    the model wrote: two engines on one checkpoint should mostly agree, and dummy weights that write
    one id over and over show it."""
    n_out = sum(map(len, outs))
    return {"seconds": round(t, 4), "two_token_seconds": round(t2, 4), "warmup_seconds": round(warmup, 4),
            "tpot_ms": round((t - t2) / (output_len - 2) * 1e3, 3),
            "output_tokens_per_s": round(n_out / t, 1), "output_tokens": n_out,
            "sample_output_ids": [int(i) for i in outs[0][:SAMPLE_IDS]] if outs else []}
