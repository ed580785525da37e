"""Host costs of offline generation that do not depend on the device (CPU, the demo model).

What the H200's fixed256 step trace showed outside its steps (benchmarks/offline/offline_steps.py), as
measured here with the same shape of workload on any machine:
  first_schedule_s     the scheduler's first step of a prefix-cached rerun of fixed256's 1000
                       prompts (all admitted at once, each needing one block), best of --repeats
  block_hash_us        hash_block_tokens of one 16-token block
  full_collection_ms   gc.collect() of the process once an LLM is built, and the objects it walks
Run it from a checkout of any commit with `PYTHONPATH=<that checkout>` to time that code.

  python benchmarks/offline/offline_host.py --output benchmarks/results/cpu/offline_host.json
"""
from __future__ import annotations

import argparse
import gc
import sys
import time
import timeit
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.append(str(ROOT))  # a PYTHONPATH given first (another checkout's package) wins

from pagedserve import LLM, SamplingParams  # noqa: E402
from pagedserve.benchmark.results import write_result  # noqa: E402
from pagedserve.core.block_pool import hash_block_tokens  # noqa: E402
from pagedserve.workloads import make_workload  # noqa: E402

DEMO = ROOT / "pagedserve/demo_model"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--output", default=None)
    args = ap.parse_args()
    llm = LLM(str(DEMO), device="cpu", max_model_len=1024, skip_tokenizer_init=True, max_num_seqs=1024,
              max_num_batched_tokens=16384)
    gc.collect()
    t0 = time.perf_counter()
    gc.collect()
    full_ms = (time.perf_counter() - t0) * 1e3
    objects = len(gc.get_objects())

    vocab = llm.llm_engine.vocab_size
    prompts = [{"prompt_token_ids": [t % vocab for t in r.prompt_token_ids]} for r in make_workload("fixed256", 1000)]
    params = SamplingParams(temperature=0.6, max_tokens=2, ignore_eos=True)
    sched = llm.llm_engine.scheduler
    schedule, firsts = sched.schedule, []

    def timed():
        t = time.perf_counter()
        out = schedule()
        firsts.append(time.perf_counter() - t)
        return out
    llm.generate(prompts, params, use_tqdm=False)  # fills the prefix cache
    sched.schedule = timed
    best = float("inf")
    for _ in range(args.repeats):
        firsts.clear()
        llm.generate(prompts, params, use_tqdm=False)
        best = min(best, firsts[0])
    sched.schedule = schedule

    block = list(range(1000, 1016))
    hash_us = min(timeit.repeat(lambda: hash_block_tokens(b"\0" * 32, block), number=20000, repeat=5)) / 20000 * 1e6
    results = {"first_schedule_s": round(best, 4), "block_hash_us": round(hash_us, 3),
               "full_collection_ms": round(full_ms, 1), "objects_walked": objects}
    print(results)
    if args.output:
        write_result(args.output, "offline_host", None,
                     {"model": "pagedserve/demo_model", "workload": "fixed256 (1000 prompts, 2 output tokens)",
                      "repeats": args.repeats}, results, device="cpu")


if __name__ == "__main__":
    main()
