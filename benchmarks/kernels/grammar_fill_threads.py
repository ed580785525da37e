"""Where a grammar fill can overlap the step loop's Python: the mechanism, without an engine.

--rows matchers of the 50 serving schemas (pagedserve/benchmark/json_schemas.py) walk together,
each step taking a token their masks allow. At every step three arrangements run on the same
matcher states (a fill only reads them), in rotating order:

  inline          fill, then the Python work (what an overlapped engine step does by default)
  fill_on_thread  the fill on a second thread while this one does the Python work, then join
                  (the removed PAGEDSERVE_GRAMMAR_FILL=background)
  work_on_thread  the Python work on a second thread while this one fills, then join
                  (PAGEDSERVE_GRAMMAR_FILL=overlap)

The Python work stands in for processing the previous step's tokens: per row, an append and an
incremental detokenization of its text so far (engine/detokenizer.py, the tokenizer's own decode,
which keeps the GIL). Reported per arrangement, ms per step (p50): the whole, and for the threaded
two when the second thread began its part (after the submit). A thread needs the GIL to begin:
fill_on_thread's fill begins only once the work, which holds the GIL, ends (or a switch interval,
5 ms, has passed), so it runs after the work, not beside it; work_on_thread's work begins as soon
as xgrammar's fill gives the GIL up, at its start.

  python benchmarks/kernels/grammar_fill_threads.py --tokenizer DIR [--rows 64] [--fill-threads 1] [--fill-pool]

--fill-pool: the fill on engine/structured/fill_pool.py's long-lived threads. Its workers need the
GIL for a moment to start and to end each chunk, so work_on_thread (the overlap) shows whether
the helper's Python holds them back.
DIR: benchmarks/serving/make_bpe_model_dir.py's output (a 128k BPE); the demo model's 2k
vocabulary (the default) makes a fill too cheap to matter. An idle core is needed for any overlap:
with torch's CPU threads busy (OMP_NUM_THREADS unset after CPU work) the threads share one.
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
import xgrammar as xgr

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # this checkout's pagedserve

from pagedserve.benchmark.json_schemas import serving_schemas  # noqa: E402
from pagedserve.config import STRUCTURED_OUTPUTS_MAX_WHITESPACE  # noqa: E402
from pagedserve.demo_model import DEMO_MODEL_DIR  # noqa: E402
from pagedserve.engine.detokenizer import detokenize_incrementally, initial_state  # noqa: E402
from pagedserve.engine.input_processor import load_tokenizer  # noqa: E402
from pagedserve.engine.structured.compiler import GrammarCompilerPool, parse_spec  # noqa: E402
from pagedserve.engine.structured.fill_pool import FillPool  # noqa: E402
from pagedserve.sampling_params import StructuredOutputsParams  # noqa: E402

ARRANGEMENTS = ("inline", "fill_on_thread", "work_on_thread")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokenizer", default=str(DEMO_MODEL_DIR))
    p.add_argument("--rows", type=int, default=64)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--fill-threads", type=int, default=1, help="xgrammar's threads for the fill")
    p.add_argument("--fill-pool", action="store_true",
                   help="fill on a FillPool of --fill-threads threads (PAGEDSERVE_GRAMMAR_FILL_POOL=1) instead")
    p.add_argument("--max-whitespace", type=int, default=STRUCTURED_OUTPUTS_MAX_WHITESPACE)
    p.add_argument("--work-scale", type=int, default=1,
                   help="detokenize each row this many times (heavier per-row work: stop strings, logprobs, ...)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()

    tok = load_tokenizer(args.tokenizer)
    vocab = len(tok)
    pool = GrammarCompilerPool(tok, vocab, [tok.eos_token_id], threads=2)
    specs = [StructuredOutputsParams(json=s) for s in serving_schemas()]
    compiled = [pool.submit(s.key(), parse_spec(s, args.max_whitespace)).result() for s in specs]
    pool.shutdown()
    rng = random.Random(args.seed)
    n = args.rows
    matchers = [xgr.GrammarMatcher(compiled[i % len(compiled)]) for i in range(n)]
    bitmask = xgr.allocate_token_bitmask(n, vocab)
    pool = FillPool(args.fill_threads) if args.fill_pool else None
    fill = pool.fill if pool else xgr.BatchGrammarMatcher(args.fill_threads).batch_fill_next_token_bitmask
    rows = list(range(n))
    prompt = tok.encode("Answer in JSON:", add_special_tokens=False)
    outputs: list[list[int]] = [[] for _ in range(n)]
    detok = [initial_state(len(prompt)) for _ in range(n)]  # as of the step's start
    texts = [""] * n
    step_text: list[tuple[str, tuple[int, int]]] = [("", s) for s in detok]  # each arrangement redoes it

    def work() -> None:  # the previous step's tokens: the text each adds
        for r in range(n):
            for _ in range(args.work_scale):
                step_text[r] = detokenize_incrementally(tok, prompt, outputs[r], detok[r])

    def do_fill() -> None:
        fill(matchers, bitmask, rows)

    second = ThreadPoolExecutor(1)
    began: list[float] = []

    def stamped(fn):
        def run():
            began.append(time.perf_counter())
            fn()
        return run

    times = {a: [] for a in ARRANGEMENTS}
    starts = {a: [] for a in ARRANGEMENTS[1:]}
    alone = {"fill": [], "work": []}
    bits = torch.arange(32, dtype=torch.int32)
    for step in range(args.steps):
        for k in range(len(ARRANGEMENTS)):
            a = ARRANGEMENTS[(step + k) % len(ARRANGEMENTS)]
            began.clear()
            t0 = time.perf_counter()
            if a == "inline":
                do_fill()
                t1 = time.perf_counter()
                work()
                alone["fill"].append(t1 - t0)
                alone["work"].append(time.perf_counter() - t1)
            elif a == "fill_on_thread":
                f = second.submit(stamped(do_fill))
                work()
                f.result()
            else:
                f = second.submit(stamped(work))
                do_fill()
                f.result()
            times[a].append(time.perf_counter() - t0)
            if began:
                starts[a].append(began[0] - t0)
        allowed = ((bitmask[:, :, None] >> bits) & 1).reshape(n, -1)[:, :vocab]
        tokens = []
        for r in range(n):
            ids = allowed[r].nonzero().flatten()
            tokens.append(int(ids[rng.randrange(len(ids))]))
        for r, (new, state) in enumerate(step_text):
            texts[r] += new
            detok[r] = state
        for m, t, out in zip(matchers, tokens, outputs):
            if not m.is_terminated():
                m.accept_token(t)
            out.append(t)
    second.shutdown()
    if pool:
        pool.close()
    ms = lambda xs: round(statistics.median(xs) * 1e3, 3)  # noqa: E731
    result = {"config": {"tokenizer": args.tokenizer, "vocab": vocab, "rows": n, "steps": args.steps,
                         "fill_threads": args.fill_threads, "fill_pool": args.fill_pool,
                         "max_whitespace": args.max_whitespace,
                         "work_scale": args.work_scale,
                         "switch_interval_s": sys.getswitchinterval()},
              "fill_ms_p50": ms(alone["fill"]), "work_ms_p50": ms(alone["work"]),
              "step_ms_p50": {a: ms(v) for a, v in times.items()},
              "second_thread_began_ms_p50": {a: ms(v) for a, v in starts.items()}}
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
