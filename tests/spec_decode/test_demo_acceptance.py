"""N-gram acceptance on the demo model (real weights) with copy-heavy prompts, in CI: the prompts of
benchmarks/offline/spec_decode_cpu.py (a held-out passage, the instruction to repeat it, the passage,
its first words again). Greedy output equals decoding without speculation, and the acceptance the
engine counts is reported and must stay high: the model copies, so a proposer that found the copy
is accepted (0.85 at batch 1 in benchmarks/results/cpu/spec_decode.json); a matcher that proposed
the wrong continuation, or a verifier that rejected good proposals, falls far below."""
import importlib.util
from pathlib import Path

from pagedserve import LLM, SamplingParams
from pagedserve.demo_model import DEMO_MODEL_DIR

ROOT = Path(__file__).resolve().parents[2]


def _cpu_bench():
    spec = importlib.util.spec_from_file_location("spec_decode_cpu", ROOT / "benchmarks/offline/spec_decode_cpu.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_copy_heavy_acceptance_on_the_demo_model(record_property):
    bench = _cpu_bench()
    copy = bench.prompts("copy", bench.passages(2))
    plain = bench.prompts("plain", bench.passages(2))
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    common = dict(device="cpu", dtype="float32", seed=0)
    base = LLM(str(DEMO_MODEL_DIR), **common)
    spec = LLM(str(DEMO_MODEL_DIR), speculative_config={"method": "ngram", "num_speculative_tokens": 4,
                                                        "prompt_lookup_min": 2, "prompt_lookup_max": 5}, **common)
    rates = {}
    for kind, prompts in (("copy", copy), ("plain", plain)):
        before = spec.get_spec_decode_stats()
        d0, a0 = before.num_draft_tokens, before.num_accepted_tokens
        want = [o.outputs[0].token_ids for o in base.generate(prompts, params, use_tqdm=False)]
        got = [o.outputs[0].token_ids for o in spec.generate(prompts, params, use_tqdm=False)]
        assert got == want, kind
        st = spec.get_spec_decode_stats()
        proposed, accepted = st.num_draft_tokens - d0, st.num_accepted_tokens - a0
        rates[kind] = accepted / proposed if proposed else None
        record_property(f"{kind}_acceptance", rates[kind])
        print(f"demo model, {kind} prompts: {accepted}/{proposed} proposed tokens accepted")
    assert rates["copy"] is not None and rates["copy"] >= 0.5, rates
