"""N-gram speculative decoding on the demo model (real weights), on CPU: acceptance on copy-heavy
prompts and the measured speed-up, greedy, with the outputs checked equal to decoding without it.

Copy-heavy prompt: a held-out passage (verses the model never saw), the instruction to repeat it,
the passage again, and its first words once more; the model continues the copy. An ordinary
prompt (the passage's first words alone) is measured beside it: the proposer then finds fewer
matches, and speculation should cost little.

  python benchmarks/offline/spec_decode_cpu.py            # writes benchmarks/results/cpu/spec_decode.json

Timing on a shared CPU: off and on run alternately, --repeats times each, and the best of each is
kept (the load average is recorded beside them); the acceptance figures do not depend on timing.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from pagedserve import SamplingParams  # noqa: E402
from pagedserve.benchmark.results import engine_switches, write_result  # noqa: E402
from pagedserve.demo_model import DEMO_MODEL_DIR  # noqa: E402
from pagedserve.entrypoints.llm import LLM  # noqa: E402


def passages(n: int) -> list[str]:
    """n held-out passages of three verses each, from different chapters."""
    lines = [l for l in (DEMO_MODEL_DIR / "heldout.txt").read_text().splitlines() if l.strip()]
    verses = [l for l in lines if not (len(l.split()) == 2 and l.split()[1].isdigit())]
    step = max(1, len(verses) // n)
    return [" ".join(verses[i * step:i * step + 3]) for i in range(n)]


def prompts(kind: str, texts: list[str]) -> list[str]:
    if kind == "copy":
        return [f"{t}\nRepeat the passage above.\n{t}\n{' '.join(t.split()[:6])}" for t in texts]
    return [" ".join(t.split()[:6]) for t in texts]


def run(llm: LLM, texts: list[str], max_tokens: int, batch: int):
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    outs, t0 = [], time.perf_counter()
    for i in range(0, len(texts), batch):
        outs += llm.generate(texts[i:i + batch], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs], time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-prompts", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    ap.add_argument("--output", default=str(ROOT / "benchmarks/results/cpu/spec_decode.json"))
    args = ap.parse_args()
    spec_cfg = {"method": "ngram", "num_speculative_tokens": args.k, "prompt_lookup_min": 2, "prompt_lookup_max": 5}
    common = dict(device="cpu", dtype="float32", seed=0)
    base = LLM(str(DEMO_MODEL_DIR), **common)
    spec = LLM(str(DEMO_MODEL_DIR), speculative_config=spec_cfg, **common)
    texts = passages(args.num_prompts)
    results = {}
    for kind in ("copy", "plain"):
        ps = prompts(kind, texts)
        for batch in (1, args.num_prompts):
            run(base, ps[:1], 8, 1)  # warm both engines
            run(spec, ps[:1], 8, 1)
            t_base = t_spec = float("inf")
            for _ in range(args.repeats):
                before = spec.get_spec_decode_stats()
                d0, t0, a0 = before.num_drafts, before.num_draft_tokens, before.num_accepted_tokens
                want, t = run(base, ps, args.max_tokens, batch)
                t_base = min(t_base, t)
                got, t = run(spec, ps, args.max_tokens, batch)
                t_spec = min(t_spec, t)
            st = spec.get_spec_decode_stats()
            drafts, draft_toks, acc = st.num_drafts - d0, st.num_draft_tokens - t0, st.num_accepted_tokens - a0
            results[f"{kind}_batch{batch}"] = {
                "outputs_equal": got == want,
                "num_drafts": drafts, "num_draft_tokens": draft_toks, "num_accepted_tokens": acc,
                "acceptance_rate": round(acc / draft_toks, 4) if draft_toks else None,
                "mean_accepted_length": round(1 + acc / drafts, 3) if drafts else None,
                "seconds_off": round(t_base, 3), "seconds_on": round(t_spec, 3),
                "speedup": round(t_base / t_spec, 3),
                "generated_tokens": sum(map(len, got)),
                "load_average_1m": round(os.getloadavg()[0], 2),
            }
            print(kind, batch, results[f"{kind}_batch{batch}"], flush=True)
    st = spec.get_spec_decode_stats()
    results["proposer_seconds_total"] = round(st.proposer_seconds, 4)
    config = {"model": "pagedserve/demo_model", "repeats_best_of": args.repeats, "speculative_config": spec.llm_engine.config.speculative_config,
              "num_prompts": args.num_prompts, "max_tokens": args.max_tokens, "greedy": True,
              "batches": [1, args.num_prompts]}
    write_result(args.output, "spec_decode_cpu", None, config, results,
                 switches=engine_switches(spec.llm_engine.config))


if __name__ == "__main__":
    main()
