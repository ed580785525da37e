"""PAGEDSERVE_GRAMMAR_FILL inline vs overlap in one engine: the host time of a constrained step's
grammar work, and the same tokens from both.

--requests requests, each with one of the 50 serving schemas (pagedserve/benchmark/json_schemas.py:
none can close before max_tokens, so every request decodes --max-tokens tokens), greedy, so both
modes must draw the same tokens. Each of --repeats rounds runs the same requests once per mode
(the order alternates), in the same engine: StructuredOutputs.overlap_fill is switched between
them, which is what PAGEDSERVE_GRAMMAR_FILL sets. A warm-up round compiles the grammars first.
Per overlapped step that fills a mask:

  host_ms  the work the modes arrange differently, on the step loop's thread: advance_and_fill
           (the accepts and the fill; with overlap, the previous step's processing runs on the
           helper inside it) + the previous step's processing when it ran after the sampler's
           launch (inline). What overlap saves is at most the smaller of the fill and that
           processing.
  step_ms  LLMEngine.step's wall time (on the CPU the forward and the sampler run inside it).
  advance_and_fill_ms, prev_after_launch_ms, join_ms: host_ms's parts (inline: the accepts and
           the fill, then the processing; overlap: both inside the first; the removed background
           mode, timed from an older checkout: the accepts, the processing, then the wait for
           its fill thread in apply()).

The first and last --trim steps of each round are left out (prefill, ramp-down). Reports p50 and
mean per mode, overlap / inline, and whether every round's tokens were equal. With
PYTHONPATH=<an older checkout> it times that code: before 'overlap' it A/Bs the `background` mode.

  python benchmarks/offline/grammar_fill_ab.py                       # the demo model (2k vocab), CPU
  python benchmarks/offline/grammar_fill_ab.py --model DIR --shrink   # DIR's tokenizer, a 2-layer model
  python benchmarks/offline/grammar_fill_ab.py --model DIR --load-format dummy --device cuda \\
      --requests 64 --output $OUT/grammar_fill_ab.json
DIR: benchmarks/serving/make_bpe_model_dir.py's output (Llama-3.1-8B's config, a 128k BPE), what the
serving benchmark's constrained runs use. --shrink keeps its tokenizer and vocabulary and makes
the layers tiny (dummy weights), so that a CPU step is mostly the grammar's host work and the
vocabulary-sized logits.
"""
from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.append(str(ROOT))  # a PYTHONPATH given first (another checkout's package) wins

from pagedserve import LLM, SamplingParams  # noqa: E402
from pagedserve.benchmark.json_schemas import schema_per_request  # noqa: E402
from pagedserve.benchmark.results import engine_switches, write_result  # noqa: E402
from pagedserve.demo_model import DEMO_MODEL_DIR  # noqa: E402
from pagedserve.engine.structured.masks import default_fill_threads  # noqa: E402
from pagedserve.sampling_params import StructuredOutputsParams  # noqa: E402

TINY = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16, "torch_dtype": "float32"}


def shrunk(model: str, into: Path) -> str:
    """A copy of model's config with TINY layers, beside its tokenizer files (dummy weights)."""
    config = json.loads((Path(model) / "config.json").read_text())
    config.update(TINY)
    config.pop("rope_scaling", None)
    (into / "config.json").write_text(json.dumps(config, indent=1))
    for f in Path(model).iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "vocab", "merges")):
            shutil.copy(f, into / f.name)
    return str(into)


class Probe:
    """Per-step timings from wrappers around the engine's own methods (no engine change)."""

    def __init__(self, engine) -> None:
        self.steps: list[dict] = []
        self._in_fill = False
        st = engine.structured
        step, aaf, process, apply = engine.step, st.advance_and_fill, engine._process_inflight, st.apply

        def timed_step(*a, **kw):
            rec = {"aaf": 0.0, "prev_after": 0.0, "join": 0.0, "masked": False}
            self.steps.append(rec)
            t = time.perf_counter()
            try:
                return step(*a, **kw)
            finally:
                rec["step"] = time.perf_counter() - t

        def timed_aaf(rows, *a, **kw):
            t = time.perf_counter()
            self._in_fill = True
            try:
                return aaf(rows, *a, **kw)
            finally:
                self._in_fill = False
                rec = self.steps[-1]
                rec["aaf"] += time.perf_counter() - t
                rec["masked"] = rec["masked"] or bool(rows)

        def timed_process(*a, **kw):
            outside = threading.current_thread() is threading.main_thread() and not self._in_fill
            t = time.perf_counter()
            try:
                return process(*a, **kw)
            finally:
                if outside and self.steps:
                    self.steps[-1]["prev_after"] += time.perf_counter() - t

        def timed_apply(logits, mask):
            filling = getattr(mask, "filling", None)  # the removed background mode's fill
            if filling is not None:
                t = time.perf_counter()
                filling.result()
                self.steps[-1]["join"] += time.perf_counter() - t
            return apply(logits, mask)

        engine.step, st.advance_and_fill, engine._process_inflight = timed_step, timed_aaf, timed_process
        st.apply = timed_apply


def _stats(xs: list[float]) -> dict:
    xs = sorted(xs)
    return {"p50": round(statistics.median(xs) * 1e3, 3), "mean": round(statistics.fmean(xs) * 1e3, 3),
            "min": round(xs[0] * 1e3, 3), "n": len(xs)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=str(DEMO_MODEL_DIR))
    p.add_argument("--shrink", action="store_true", help="tiny layers around --model's tokenizer (CPU)")
    p.add_argument("--load-format", default="auto")
    p.add_argument("--device", default="cpu")
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--trim", type=int, default=4)
    p.add_argument("--output", default=None)
    args = p.parse_args()

    tmp = tempfile.TemporaryDirectory()
    model = shrunk(args.model, Path(tmp.name)) if args.shrink else args.model
    kw = dict(device=args.device, load_format="dummy" if args.shrink else args.load_format,
              max_num_seqs=max(args.requests, 8))
    if args.device == "cpu":
        kw["dtype"] = "float32"
    llm = LLM(model, **kw)
    engine = llm.llm_engine
    vocab = engine.vocab_size
    prompts = [{"prompt_token_ids": [(7 + 31 * i + 5 * j) % vocab for j in range(8)]} for i in range(args.requests)]
    params = [SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True,
                             structured_outputs=StructuredOutputsParams(json=s))
              for s in schema_per_request(args.requests)]
    llm.generate(prompts, params, use_tqdm=False)  # compiles every grammar (cached from here on)
    probe = Probe(engine)
    st = engine.structured
    # This checkout's overlap, or (PYTHONPATH=an older checkout) the background mode it replaced.
    switch = "overlap_fill" if hasattr(st, "overlap_fill") else "fill_in_background"
    modes = ("inline", "overlap" if switch == "overlap_fill" else "background")
    per_mode = {m: {"host": [], "step": [], "advance_and_fill": [], "prev_after_launch": [], "join": []}
                for m in modes}
    same = True
    for r in range(args.repeats):
        tokens = {}
        for mode in (modes if r % 2 == 0 else modes[::-1]):
            setattr(st, switch, mode != "inline")
            probe.steps.clear()
            outs = llm.generate(prompts, params, use_tqdm=False)
            tokens[mode] = [list(o.outputs[0].token_ids) for o in outs]
            steps = [s for s in probe.steps if s["masked"]][args.trim:-args.trim or None]
            per_mode[mode]["host"] += [s["aaf"] + s["prev_after"] + s["join"] for s in steps]
            per_mode[mode]["step"] += [s["step"] for s in steps]
            per_mode[mode]["advance_and_fill"] += [s["aaf"] for s in steps]
            per_mode[mode]["prev_after_launch"] += [s["prev_after"] for s in steps]
            per_mode[mode]["join"] += [s["join"] for s in steps]
        same = same and tokens[modes[0]] == tokens[modes[1]]
    llm.shutdown()
    results = {m: {f"{k}_ms": _stats(xs) for k, xs in v.items()} for m, v in per_mode.items()}
    results[f"{modes[1]}_over_inline"] = {
        k: round(results[modes[1]][k]["p50"] / results["inline"][k]["p50"], 3) for k in ("host_ms", "step_ms")}
    results["same_tokens"] = same
    config = {"model": args.model, "shrink": args.shrink, "vocab_size": vocab, "device": args.device,
              "requests": args.requests, "max_tokens": args.max_tokens, "repeats": args.repeats,
              "trim": args.trim, "fill_threads": default_fill_threads()}
    print(json.dumps({"config": config, "results": results}, indent=1))
    if args.output:
        write_result(args.output, "grammar_fill_ab", None, config, results,
                     ratios={f"{modes[1]}_over_inline_{k}": v for k, v in results[f"{modes[1]}_over_inline"].items()},
                     switches=engine_switches(), device=None if args.device != "cpu" else "cpu")
    if not same:
        sys.exit("the two modes drew different tokens")


if __name__ == "__main__":
    main()
