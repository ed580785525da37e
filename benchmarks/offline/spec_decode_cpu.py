"""N-gram speculative decoding on the demo model (real weights), on CPU: acceptance on copy-heavy
prompts and the measured speed-up, greedy, with the outputs checked equal to decoding without it;
and low acceptance, where yield pausing (speculative_config.min_speculation_yield) should keep
speculation from costing more than it gives.

Copy-heavy prompt: a held-out passage (verses the model never saw), the instruction to repeat it,
the passage again, and its first words once more; the model continues the copy. An ordinary
prompt (the passage's first words alone) is measured beside it: the proposer then finds fewer
matches, and speculation should cost little. Both are timed with the shipped policy (yield
pausing included) and without pausing: what pausing costs where speculation pays.

Low acceptance: the plain prompts with the benchmark-only acceptance-controlled proposer
(spec_decode/synthetic.py: a replay of the reference output, each proposed token corrupted with
probability 1 - a) at a = 0 (every proposal rejected) and 0.2 (a step yields ~1.25 tokens a
row with k = 4, the default threshold), each timed off, on with the shipped policy (pausing) and
on without pausing (min_speculation_yield 0).

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
from pagedserve.spec_decode.config import DEFAULT_MIN_SPECULATION_YIELD  # noqa: E402
from pagedserve.spec_decode.policy import SpeculationPolicy  # noqa: E402
from pagedserve.spec_decode.synthetic import AcceptanceControlledProposer, ReplayProposer  # noqa: E402

LOW_ACCEPTANCE = (0.0, 0.2)


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


def run(llm: LLM, texts: list[str], max_tokens: int, batch: int, full: bool = False):
    """Output token ids (full: prompt + output ids) and seconds, the texts in batches of `batch`."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    outs, t0 = [], time.perf_counter()
    for i in range(0, len(texts), batch):
        outs += llm.generate(texts[i:i + batch], params, use_tqdm=False)
    t = time.perf_counter() - t0
    return [(list(o.prompt_token_ids) if full else []) + list(o.outputs[0].token_ids) for o in outs], t


def use(llm: LLM, proposer, min_yield: float) -> None:
    """Give the engine's speculator this proposer and a fresh policy (k and the batch rule as
    configured) with this yield threshold."""
    sp, cfg = llm.llm_engine.speculator, llm.llm_engine.speculator.spec
    sp.proposer = proposer
    sp.policy = SpeculationPolicy(cfg.num_speculative_tokens, cfg.spec_disable_batch_tokens,
                                  cfg.disable_by_batch_size, min_yield)


def low_acceptance(base: LLM, spec: LLM, ps: list[str], args) -> dict:
    """Off, on with pausing and on without, for each a in LOW_ACCEPTANCE and each batch."""
    ngram = spec.llm_engine.speculator.proposer
    vocab = spec.llm_engine.vocab_size
    results = {}
    for a in LOW_ACCEPTANCE:
        for batch in (1, args.num_prompts):
            # The reference (prompt + output ids, at this batch): what the replay proposes and what
            # speculation must reproduce.
            want, _ = run(base, ps, args.max_tokens, batch, full=True)
            secs = {"off": float("inf"), "pausing": float("inf"), "no_pausing": float("inf")}
            counts, equal = {}, True
            for _ in range(args.repeats):
                _, t = run(base, ps, args.max_tokens, batch)
                secs["off"] = min(secs["off"], t)
                for mode, min_yield in (("pausing", DEFAULT_MIN_SPECULATION_YIELD), ("no_pausing", 0.0)):
                    # The same seed each time: every run corrupts the same proposals.
                    use(spec, AcceptanceControlledProposer(ReplayProposer(want), a, vocab, seed=batch), min_yield)
                    st = spec.get_spec_decode_stats()
                    before = (st.num_spec_steps, st.num_draft_tokens, st.num_accepted_tokens, st.num_paused_steps)
                    got, t = run(spec, ps, args.max_tokens, batch, full=True)
                    secs[mode] = min(secs[mode], t)
                    equal = equal and got == want
                    now = (st.num_spec_steps, st.num_draft_tokens, st.num_accepted_tokens, st.num_paused_steps)
                    counts[mode] = dict(zip(("spec_steps", "draft_tokens", "accepted_tokens", "paused_steps"),
                                            (n - b for n, b in zip(now, before))))
            r = {"outputs_equal": equal, "acceptance_asked": a}
            for mode, c in counts.items():
                r[f"{mode}_acceptance_rate"] = round(c["accepted_tokens"] / c["draft_tokens"], 4) \
                    if c["draft_tokens"] else None
                r.update({f"{mode}_{k}": v for k, v in c.items()})
            r.update(seconds_off=round(secs["off"], 3), seconds_on_pausing=round(secs["pausing"], 3),
                     seconds_on_no_pausing=round(secs["no_pausing"], 3),
                     pausing_over_off=round(secs["pausing"] / secs["off"], 3),
                     no_pausing_over_off=round(secs["no_pausing"] / secs["off"], 3),
                     load_average_1m=round(os.getloadavg()[0], 2))
            results[f"synthetic_a{a:g}_batch{batch}"] = r
            print(f"a={a} batch {batch}", r, flush=True)
    use(spec, ngram, DEFAULT_MIN_SPECULATION_YIELD)
    return results


def table(doc: dict) -> str:
    """The markdown beside the JSON: one row per prompt kind and batch, then the low-acceptance
    runs."""
    rows = ["| prompts, batch | outputs equal | acceptance | mean accepted length | paused steps | off s | on s | "
            "speed-up | on, no pausing s | speed-up, no pausing | load 1m |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    low = ["| proposer, batch | outputs equal | acceptance | speculating / paused steps (pausing) | speculating "
           "steps (no pausing) | off s | on, pausing s | on, no pausing s | pausing / off | no pausing / off | "
           "load 1m |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for key, r in doc["results"].items():
        if isinstance(r, dict) and "acceptance_asked" in r:
            low.append(f"| {key} | {r['outputs_equal']} | {r['no_pausing_acceptance_rate']} | "
                       f"{r['pausing_spec_steps']} / {r['pausing_paused_steps']} | {r['no_pausing_spec_steps']} | "
                       f"{r['seconds_off']} | {r['seconds_on_pausing']} | {r['seconds_on_no_pausing']} | "
                       f"{r['pausing_over_off']} | {r['no_pausing_over_off']} | {r.get('load_average_1m')} |")
        elif isinstance(r, dict):
            rows.append(f"| {key} | {r['outputs_equal']} | {r['acceptance_rate']} | {r['mean_accepted_length']} | "
                        f"{r.get('num_paused_steps')} | {r['seconds_off']} | {r['seconds_on']} | {r['speedup']} | "
                        f"{r.get('seconds_on_no_pausing')} | {r.get('speedup_no_pausing')} | {r.get('load_average_1m')} |")
    return (f"# {doc['benchmark']}\n\n`{doc['command']}` at {doc['commit'][:12]} on {doc['device']}, "
            f"speculative_config {doc['config']['speculative_config']}\n\n" + "\n".join(rows)
            + "\n\nOn (the shipped policy, yield pausing included) and on without pausing (min_speculation_yield 0); "
              "counts from the last repeat with pausing.\n\nLow acceptance (the synthetic proposer; seconds: lower is better, ratios over off: below 1 "
              "is faster than speculation off):\n\n" + "\n".join(low))


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
    ngram = spec.llm_engine.speculator.proposer
    for kind in ("copy", "plain"):
        ps = prompts(kind, texts)
        for batch in (1, args.num_prompts):
            run(base, ps[:1], 8, 1)  # warm both engines
            run(spec, ps[:1], 8, 1)
            t_base = t_spec = t_nopause = float("inf")
            equal = True
            for _ in range(args.repeats):
                want, t = run(base, ps, args.max_tokens, batch)
                t_base = min(t_base, t)
                # The shipped policy (counted), then the same without yield pausing.
                use(spec, ngram, DEFAULT_MIN_SPECULATION_YIELD)
                st = spec.get_spec_decode_stats()
                d0, t0, a0, p0 = st.num_drafts, st.num_draft_tokens, st.num_accepted_tokens, st.num_paused_steps
                got, t = run(spec, ps, args.max_tokens, batch)
                t_spec = min(t_spec, t)
                drafts, draft_toks, acc = st.num_drafts - d0, st.num_draft_tokens - t0, st.num_accepted_tokens - a0
                paused = st.num_paused_steps - p0
                use(spec, ngram, 0.0)
                got_nopause, t = run(spec, ps, args.max_tokens, batch)
                t_nopause = min(t_nopause, t)
                equal = equal and got == want == got_nopause
            use(spec, ngram, DEFAULT_MIN_SPECULATION_YIELD)
            results[f"{kind}_batch{batch}"] = {
                "outputs_equal": equal,
                "num_drafts": drafts, "num_draft_tokens": draft_toks, "num_accepted_tokens": acc,
                "num_paused_steps": paused,
                "acceptance_rate": round(acc / draft_toks, 4) if draft_toks else None,
                "mean_accepted_length": round(1 + acc / drafts, 3) if drafts else None,
                "seconds_off": round(t_base, 3), "seconds_on": round(t_spec, 3),
                "speedup": round(t_base / t_spec, 3),
                "seconds_on_no_pausing": round(t_nopause, 3), "speedup_no_pausing": round(t_base / t_nopause, 3),
                "generated_tokens": sum(map(len, got)),
                "load_average_1m": round(os.getloadavg()[0], 2),
            }
            print(kind, batch, results[f"{kind}_batch{batch}"], flush=True)
    st = spec.get_spec_decode_stats()
    results["proposer_seconds_total"] = round(st.proposer_seconds, 4)
    results.update(low_acceptance(base, spec, prompts("plain", texts), args))
    config = {"model": "pagedserve/demo_model", "repeats_best_of": args.repeats, "speculative_config": spec.llm_engine.config.speculative_config,
              "num_prompts": args.num_prompts, "max_tokens": args.max_tokens, "greedy": True,
              "batches": [1, args.num_prompts], "low_acceptance": list(LOW_ACCEPTANCE),
              "low_acceptance_proposer": "AcceptanceControlledProposer(ReplayProposer(reference outputs), a)"}
    write_result(args.output, "spec_decode_cpu", None, config, results,
                 switches=engine_switches(spec.llm_engine.config), table_md=table)


if __name__ == "__main__":
    main()
