"""Speculative decoding: TPOT and throughput against acceptance rate and k, beside speculation off,
the adaptive policy, and vLLM 0.26 in the same set-up (issue #36).

Set-up, both engines alike: Llama-3.1-8B's config with dummy weights, bf16, greedy, ignore_eos,
prefix caching off; each prompt PROMPT_LEN ids (a random passage of PROMPT_LEN / 2 ids written
twice: copy-heavy, so n-gram lookup has something to find), OUTPUT_LEN new tokens; batches of 1, 8,
32 and 128 requests submitted at once. Per (config, batch): t2 = seconds of a generate with
max_tokens=2 (prefill, first token and one decode step; 2 rather than 1 because our engine with
speculation on never reports a max_tokens=1 request finished to LLM.generate, a bug left to the
engine's owner), t = seconds of the full generate;
TPOT = (t - t2) / (OUTPUT_LEN - 2) and throughput = batch * OUTPUT_LEN / t (output tokens/s).

Sections, each one process that fits a 10-minute device call (benchmarks/spec_h200.sh runs them):
  ours --config off        speculation off (no speculative_config): the baseline, every batch
  ours --config spec --batches B   one engine with speculative_config draft_model, draft = target (the
                           same config and dummy weights: its greedy proposals are the target's), whose
                           proposer and policy are switched between runs (LLMEngine.speculator):
                           for k in 1, 2, 4 with the adaptive policy off (spec_disable_batch_tokens 2**30,
                           min_speculation_yield 0: no pausing):
                             k{k}_ngram         prompt lookup, as shipped;
                             k{k}_draft_a{a}    the draft model, each proposal corrupted with probability
                                                1 - a (spec_decode/synthetic.py, benchmark-only);
                             k{k}_replay_a{a}   the same corruption around a replay of the target's own
                                                greedy output (a free draft: what verification alone
                                                costs and gains);
                           then the default adaptive policy (batch rule and yield pausing) at k = 4:
                             adaptive_ngram, adaptive_draft, and adaptive_draft_a0 / adaptive_replay_a0
                             (every proposal rejected: pausing should bring these near speculation off),
                             adaptive_empty (a proposer that never has anything: likewise)
  vllm --config off | draft_model_kK | ngram_kK   vLLM offline with speculative_config (draft = target:
                           {"method": "draft_model", "model": <the same dir>}; {"method": "ngram"});
                           run it with vLLM on PYTHONPATH (--site DIR adds it)
  ours --config spec --grid quick   the same engine, every batch in it, a coarser grid (spec_plan):
                           the adaptive runs, then k4_draft_a1, k4_replay_a1 and k4_ngram (what the
                           targets need) at every batch first; then the acceptance sweep at k = 4 only
                           (draft and replay at each a) and k = 1, 2 at a = 1 only (draft and replay),
                           no n-gram at k = 1, 2. 18 runs a batch instead of 32, one engine instead of four
  collect                  merges the parts into benchmarks/results/h200/spec_decode.json; config.grids
                           says which grid each part ran, `targets` the issue's targets against the figures
  smoke                    CPU, a tiny config: both `ours` sections and collect in one process (--grid too)
Acceptance is measured (accepted / proposed tokens, from the engine's counters) beside the a
that was asked for: with corruption probability 1 - a per token, greedy verification accepts
proposal j with probability a**j.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

MODEL = str(ROOT / "benchmarks/models/llama-3.1-8b")
PROMPT_LEN, OUTPUT_LEN = 128, 128
BATCHES = (1, 8, 32, 128)
KS = (1, 2, 4)
ACCEPTS = (0.0, 0.5, 0.8, 1.0)
FIXED = 1 << 30            # spec_disable_batch_tokens that never turns speculation off
ADAPTIVE_K = 4
GRIDS = ("full", "quick")  # spec_plan
PARTS = ROOT / "benchmarks/results/h200/spec_decode_parts"
OUTPUT = ROOT / "benchmarks/results/h200/spec_decode.json"
VLLM_ENV = {"VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
            "TOKENIZERS_PARALLELISM": "false", "VLLM_USE_FLASHINFER_SAMPLER": "0"}


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


def _sync() -> None:
    import torch
    if torch.cuda.is_available():
        torch.cuda.synchronize()


# --- the pagedserve side ----------------------------------------------------------------------------
# The engine's speculative-decoding state is LLMEngine.speculator (engine/speculation.py): its proposer,
# its adaptive policy (k, the batch-token threshold and the yield pause) and its counters.
def speculator(llm):
    return llm.llm_engine.speculator


def set_proposer(llm, proposer) -> None:
    speculator(llm).proposer = proposer


def get_proposer(llm):
    return speculator(llm).proposer


def set_policy(llm, k: int, disable_batch_tokens: int, min_speculation_yield: float) -> None:
    """A fresh policy for a run (no pause carried over from the last one); k at most the engine's
    configured k (what its start-up sized for)."""
    from pagedserve.spec_decode.policy import SpeculationPolicy
    speculator(llm).policy = SpeculationPolicy(k, disable_batch_tokens, min_speculation_yield=min_speculation_yield)


def counters(llm) -> tuple[int, int, int]:
    """(proposed, accepted) tokens and paused steps so far, from the engine's speculative-decoding
    counters."""
    s = speculator(llm).stats
    return int(s.num_draft_tokens), int(s.num_accepted_tokens), int(s.num_paused_steps)


class NoProposals:
    """Proposes nothing: the engine decodes one token per step (for the replay's recordings)."""

    def propose(self, requests):
        from pagedserve.spec_decode.proposer import Proposals
        return Proposals([[] for _ in requests], None)

    def finish(self, seq_id: int) -> None:
        pass


def _generate(llm, prompts, max_tokens: int):
    from pagedserve import SamplingParams
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    _sync()
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    _sync()
    return time.perf_counter() - t0, [list(o.outputs[0].token_ids) for o in outs]


def measure(llm, prompts, output_len: int, spec: bool) -> dict:
    """TPOT, throughput and (with speculation) the measured acceptance of one batch."""
    t2, _ = _generate(llm, prompts, 2)
    before = counters(llm) if spec else (0, 0, 0)
    t, outs = _generate(llm, prompts, output_len)
    n_out = sum(map(len, outs))
    res = {"seconds": round(t, 4), "two_token_seconds": round(t2, 4),
           "tpot_ms": round((t - t2) / (output_len - 2) * 1e3, 3),
           "output_tokens_per_s": round(n_out / t, 1), "output_tokens": n_out}
    if spec:
        proposed, accepted, paused = (a - b for a, b in zip(counters(llm), before))
        res.update(proposed_tokens=proposed, accepted_tokens=accepted, paused_steps=paused,
                   acceptance_rate=round(accepted / proposed, 4) if proposed else None)
    return res


def build_llm(model: str, args, spec: dict | None):
    from pagedserve import LLM
    kw = dict(load_format="dummy", skip_tokenizer_init=True, max_model_len=args.max_model_len, seed=0,
              max_num_seqs=max(args.batches), enable_prefix_caching=False, device=args.device)
    if args.device != "cpu":
        kw["gpu_memory_utilization"] = args.gpu_memory_utilization
    if spec is not None:
        kw["speculative_config"] = spec
    return LLM(model, **kw, **json.loads(args.engine_args))


def free(llm) -> None:
    llm.llm_engine.shutdown()
    del llm
    gc.collect()
    import torch
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def spec_plan(grid: str, ks: list[int], accepts: list[float]) -> list[tuple[int, str, int, bool, str, float | None]]:
    """The runs of one batch in an `ours --config spec` section, in order, as (tier, name, k, adaptive,
    proposer, a): proposer "ngram", "draft" (the draft model = target) or "replay" (the target's own
    greedy output), corrupted at acceptance a (None: not corrupted); adaptive: the default policy
    (batch rule and yield pausing) at k = ADAPTIVE_K, else a fixed k with pausing off.
    A section runs tier 0 at every batch, then tier 1 at every batch, so a section cut by its time
    limit has the targets' runs at every batch.
    full:  tier 0 the five adaptive runs; tier 1 for each k of ks, n-gram, then draft and replay at
           each a of accepts (5 + 3 * (1 + 2 * 4) = 32 runs with the defaults).
    quick: tier 0 the five adaptive runs and k4_draft_a1, k4_replay_a1, k4_ngram (batch 1's 0.4x target,
           the vLLM comparison at k = 4); tier 1 the acceptance sweep at k = ADAPTIVE_K only (draft and
           replay at each other a of accepts), then draft and replay at a = 1 for each other k of ks
           (8 + 6 + 4 = 18 runs with the defaults).
    adaptive_empty: a proposer that never has anything (an n-gram over text that does not repeat):
           the policy's empty-step pause should keep it near speculation off."""
    if grid not in GRIDS:
        raise SystemExit(f"--grid must be one of {GRIDS}, got {grid!r}")
    plan = [(0, "adaptive_ngram", ADAPTIVE_K, True, "ngram", None),
            (0, "adaptive_draft", ADAPTIVE_K, True, "draft", None),
            (0, "adaptive_draft_a0", ADAPTIVE_K, True, "draft", 0.0),
            (0, "adaptive_replay_a0", ADAPTIVE_K, True, "replay", 0.0),
            (0, "adaptive_empty", ADAPTIVE_K, True, "none", None)]

    def pair(tier: int, k: int, a: float) -> list:
        return [(tier, f"k{k}_{kind}_a{a:g}", k, False, kind, a) for kind in ("draft", "replay")]

    if grid == "full":
        for k in ks:
            plan.append((1, f"k{k}_ngram", k, False, "ngram", None))
            for a in accepts:
                plan += pair(1, k, a)
        return plan
    k = ADAPTIVE_K
    plan += pair(0, k, 1.0) + [(0, f"k{k}_ngram", k, False, "ngram", None)]
    for a in accepts:
        if a != 1.0:
            plan += pair(1, k, a)
    for other in ks:
        if other != k:
            plan += pair(1, other, 1.0)
    return plan


def ours(config: str, args, checkpoint=None) -> dict:
    """One `ours` section: {"bB": {run name: measure()}} for each batch of args.batches.
    config "off": one run per batch. config "spec": one engine (draft model = target, k = max(ks, ADAPTIVE_K))
    whose proposer and policy are switched between runs, spec_plan(args.grid) at every batch, a tier at
    a time (tier 0 at every batch, then tier 1). checkpoint(results), when given, is called after every
    run with what is measured so far."""
    from pagedserve.spec_decode.config import DEFAULT_DISABLE_BATCH_TOKENS, DEFAULT_MIN_SPECULATION_YIELD
    from pagedserve.spec_decode.ngram import NgramProposer
    from pagedserve.spec_decode.synthetic import AcceptanceControlledProposer, ReplayProposer

    model = args.model
    spec = None
    if config == "spec":
        spec = {"method": "draft_model", "model": model, "num_speculative_tokens": max(args.ks + [ADAPTIVE_K]),
                "spec_disable_batch_tokens": FIXED}
    elif config != "off":
        raise SystemExit(f"ours: --config must be off or spec, got {config!r}")
    plan = spec_plan(args.grid, args.ks, args.accepts) if spec is not None else []
    t0 = time.perf_counter()
    llm = build_llm(model, args, spec)
    log(f"ours {config}: engine up in {time.perf_counter() - t0:.1f} s")
    vocab = llm.llm_engine.vocab_size
    results: dict = {"engine_seconds": round(time.perf_counter() - t0, 1)}
    _generate(llm, make_prompts(2, args.prompt_len, vocab, seed=1), 4)  # warm-up
    prompts = {b: make_prompts(b, args.prompt_len, vocab) for b in args.batches}
    if spec is None:
        for b in args.batches:
            results[f"b{b}"] = {"off": measure(llm, prompts[b], args.output_len, spec=False)}
            log(f"ours off b{b}: {results[f'b{b}']['off']}")
            if checkpoint is not None:
                checkpoint(results)
        free(llm)
        return results
    draft, ngram = get_proposer(llm), NgramProposer(1, 5)
    replay = {}
    set_proposer(llm, NoProposals())
    for b in args.batches:
        _, recorded = _generate(llm, prompts[b], args.output_len)
        replay[b] = [p + o for p, o in zip(prompts[b], recorded)]
        results[f"b{b}"] = {}
    adaptive = (DEFAULT_DISABLE_BATCH_TOKENS, DEFAULT_MIN_SPECULATION_YIELD)

    def proposer_for(kind: str, a: float | None, b: int):
        if kind == "none":
            return NoProposals()
        inner = ReplayProposer(replay[b]) if kind == "replay" else {"ngram": ngram, "draft": draft}[kind]
        return inner if a is None else AcceptanceControlledProposer(inner, a, vocab, seed=b)

    for tier in sorted({run[0] for run in plan}):
        for b in args.batches:
            for _, name, k, is_adaptive, kind, a in (run for run in plan if run[0] == tier):
                set_proposer(llm, proposer_for(kind, a, b))
                set_policy(llm, k, *(adaptive if is_adaptive else (FIXED, 0.0)))
                results[f"b{b}"][name] = measure(llm, prompts[b], args.output_len, spec=True)
                log(f"ours spec b{b} {name}: {results[f'b{b}'][name]}")
                if checkpoint is not None:
                    checkpoint(results)
    set_proposer(llm, draft)
    free(llm)
    return results


# --- the vLLM side ----------------------------------------------------------------------------------
def vllm_counters(llm) -> tuple[int, int] | None:
    """(draft tokens, accepted tokens) from vLLM's metrics (vllm:spec_decode_*), None if absent."""
    try:
        metrics = llm.get_metrics()
    except Exception:  # noqa: BLE001 (an older vLLM, or stats off)
        return None
    got = {m.name: getattr(m, "value", None) for m in metrics}
    d, a = got.get("vllm:spec_decode_num_draft_tokens"), got.get("vllm:spec_decode_num_accepted_tokens")
    return None if d is None or a is None else (int(d), int(a))


def vllm(config: str, args, checkpoint=None) -> dict:
    """One vLLM config (off, draft_model_kK, ngram_kK): {"bB": {...}} for each batch of args.batches;
    checkpoint(results), when given, after the start and after every batch."""
    import shutil

    import vllm as vllm_pkg
    from vllm import LLM, SamplingParams

    for k, v in VLLM_ENV.items():
        os.environ.setdefault(k, v)
    vocab = json.loads((Path(args.model) / "config.json").read_text())["vocab_size"]
    model_dir = tempfile.mkdtemp(prefix="spec_vllm_")
    shutil.copy(Path(args.model) / "config.json", Path(model_dir) / "config.json")
    kw = dict(model=model_dir, load_format="dummy", skip_tokenizer_init=True, dtype="bfloat16",
              max_model_len=args.max_model_len, gpu_memory_utilization=args.vllm_gpu_memory_utilization,
              max_num_seqs=max(args.batches), enable_prefix_caching=False, seed=0, disable_log_stats=False)
    if config != "off":
        method, k = config.rsplit("_k", 1)
        spec = {"method": method, "num_speculative_tokens": int(k)}
        if method == "draft_model":
            spec["model"] = model_dir
        else:
            spec.update(prompt_lookup_min=1, prompt_lookup_max=5)
        kw["speculative_config"] = spec
    t0 = time.perf_counter()
    llm = LLM(**kw)
    results: dict = {"engine_seconds": round(time.perf_counter() - t0, 1), "vllm_version": vllm_pkg.__version__,
                     "llm_kwargs": {k: v for k, v in kw.items() if k != "model"}}
    log(f"vllm {config}: engine up in {results['engine_seconds']} s")
    if checkpoint is not None:
        checkpoint(results)

    def gen(prompts, n):
        params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
        _sync()
        t = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        _sync()
        return time.perf_counter() - t, sum(len(o.outputs[0].token_ids) for o in outs)

    gen(make_prompts(2, args.prompt_len, vocab, seed=1), 4)
    for b in args.batches:
        prompts = make_prompts(b, args.prompt_len, vocab)
        t2, _ = gen(prompts, 2)
        before = vllm_counters(llm)
        t, n_out = gen(prompts, args.output_len)
        after = vllm_counters(llm)
        res = {"seconds": round(t, 4), "two_token_seconds": round(t2, 4),
               "tpot_ms": round((t - t2) / (args.output_len - 2) * 1e3, 3),
               "output_tokens_per_s": round(n_out / t, 1), "output_tokens": n_out}
        if before is not None and after is not None and after[0] > before[0]:
            res.update(proposed_tokens=after[0] - before[0], accepted_tokens=after[1] - before[1],
                       acceptance_rate=round((after[1] - before[1]) / (after[0] - before[0]), 4))
        results[f"b{b}"] = res
        log(f"vllm {config} b{b}: {res}")
        if checkpoint is not None:
            checkpoint(results)
    shutil.rmtree(model_dir, ignore_errors=True)
    return results


# --- collect ------------------------------------------------------------------------------------------
def merge_parts(parts_dir: Path) -> tuple[dict, set]:
    """{"ours": {"bB": {run: ...}}, "vllm": {config: {"bB": {...}}}} from the part files, and their
    (device, commit) stamps (vLLM parts carry commit "vllm")."""
    merged: dict = {"ours": {}, "vllm": {}, "setup": {}, "host": {}}
    stamps = set()
    for f in sorted(parts_dir.glob("*.json")):
        doc = json.loads(f.read_text())
        stamps.add((doc["device"], doc["commit"]))
        merged["setup"][f.stem] = doc.get("setup")
        merged["host"][f.stem] = doc.get("host")
        if f.stem.startswith("vllm_"):
            merged["vllm"][f.stem[len("vllm_"):]] = doc["results"]
        else:
            for key, runs in doc["results"].items():
                if key.startswith("b") and isinstance(runs, dict):
                    merged["ours"].setdefault(key, {}).update(runs)
                else:
                    merged["ours"].setdefault("engine_seconds", {})[f.stem] = runs
    return merged, stamps


def _tpot(section: dict, batch: int, run: str | None = None) -> float | None:
    r = section.get(f"b{batch}")
    if r is not None and run is not None:
        r = r.get(run)
    return None if r is None else r.get("tpot_ms")


def _ratio(x: float | None, y: float | None) -> float | None:
    # A TPOT at or below 0 (a run too short to time: only on the CPU smoke) gives no ratio.
    return round(x / y, 3) if x is not None and y is not None and x > 0 and y > 0 else None


def ratios_of(merged: dict, batches, ks) -> dict:
    ours, theirs = merged["ours"], merged["vllm"]
    off = {b: _tpot(ours, b, "off") for b in batches}
    r = {"tpot_b1_k4_a100_over_off": _ratio(_tpot(ours, 1, "k4_replay_a1"), off.get(1)),
         "tpot_b1_k4_a100_draft_over_off": _ratio(_tpot(ours, 1, "k4_draft_a1"), off.get(1))}
    for b in batches:
        r[f"adaptive_over_off_b{b}"] = _ratio(_tpot(ours, b, "adaptive_ngram"), off[b])
        r[f"adaptive_draft_over_off_b{b}"] = _ratio(_tpot(ours, b, "adaptive_draft"), off[b])
        for name in ("adaptive_draft_a0", "adaptive_replay_a0", "adaptive_empty"):
            r[f"{name}_over_off_b{b}"] = _ratio(_tpot(ours, b, name), off[b])
    # Only the vLLM configs that ran (the quick plan runs off, draft_model_k4 and ngram_k4), each
    # against our run of the same set-up: off, kK_draft_a1 (draft = target), kK_ngram.
    for config in sorted(theirs):
        method, _, k = config.rpartition("_k")
        mine = {"off": "off", "draft_model": f"k{k}_draft_a1", "ngram": f"k{k}_ngram"}.get(method or config)
        if mine is None:
            continue
        label = "off" if mine == "off" else f"{method.split('_')[0]}_k{k}"
        for b in batches:
            r[f"tpot_{label}_b{b}_over_vllm"] = _ratio(_tpot(ours, b, mine), _tpot(theirs[config], b))
    return r


def targets_of(ratios: dict, batches) -> dict:
    """The issue's H200 targets against the collected ratios: {target: {"value", "limit", "met"}}
    (met None where a figure is missing). The adaptive target takes the worst ratio over batches and
    over the n-gram, draft and every-proposal-rejected runs; the vLLM target the worst of the matching
    set-ups (draft = target and n-gram, every k and batch that ran)."""
    def target(values: list, limit: float) -> dict:
        got = [v for v in values if v is not None]
        worst = max(got) if got else None
        return {"value": worst, "limit": limit,
                "met": None if worst is None or len(got) < len(values) else worst <= limit}

    adaptive = [ratios.get(f"{n}_over_off_b{b}") for b in batches
                for n in ("adaptive", "adaptive_draft", "adaptive_draft_a0", "adaptive_replay_a0", "adaptive_empty")]
    vs_vllm = [v for n, v in ratios.items() if n.endswith("_over_vllm") and not n.startswith("tpot_off_")]
    return {"b1_k4_a100_replay_tpot_over_off": target([ratios.get("tpot_b1_k4_a100_over_off")], 0.4),
            "b1_k4_a100_draft_tpot_over_off": target([ratios.get("tpot_b1_k4_a100_draft_over_off")], 0.4),
            "adaptive_tpot_over_off_worst": target(adaptive, 1.02),
            "tpot_over_vllm_worst": target(vs_vllm, 1.0) if vs_vllm else {"value": None, "limit": 1.0, "met": None}}


NOTES = {
    "tpot_b1_k4_a100_over_off": "replay proposer (the target's own greedy output, free to propose), k = 4, a = 1, "
                                "batch 1: what verifying 4 proposals per step gains when all are accepted",
    "tpot_b1_k4_a100_draft_over_off": "the same with the draft model = target: each proposal costs a forward of a "
                                      "target-sized draft, so this cannot go far below 1 however cheap verification "
                                      "is; a real, smaller draft sits between the two ratios",
    "adaptive_over_off_bB": "n-gram proposer, default adaptive policy (k = 4, spec_disable_batch_tokens at its default) against "
                            "speculation off; adaptive_draft_over_off_bB: the same with the draft model = target",
    "adaptive_draft_a0_over_off_bB": "the default adaptive policy with every proposal rejected (draft = target, "
                                     "or replay, corrupted at a = 0): yield pausing keeps most steps plain and "
                                     "overlapped, so this should stay near 1 (k4_draft_a0 is the same without it)",
    "adaptive_empty_over_off_bB": "the default adaptive policy with a proposer that never has anything (an n-gram "
                                  "over text that does not repeat): the policy's empty-step pause should keep "
                                  "this near 1",
    "acceptance": "runs *_aA corrupt each proposal with probability 1 - A (spec_decode/synthetic.py); "
                  "acceptance_rate is what the engine's counters measured",
}


def collect(parts_dir: Path, output: Path, batches, ks, device: str | None = None) -> dict:
    from pagedserve.benchmark.results import write_result

    merged, stamps = merge_parts(parts_dir)
    ours_commits = {c for _, c in stamps if c != "vllm"}
    devices = {d for d, _ in stamps}
    if len(devices) > 1 or len(ours_commits) > 1:
        raise SystemExit(f"the parts come from several devices or commits {sorted(stamps)}: re-run them at one")
    ratios = ratios_of(merged, batches, ks)
    setups = [v for v in merged["setup"].values() if v]
    if any(s_[key] != setups[0][key] for s_ in setups for key in ("model", "prompt_len", "output_len")):
        raise SystemExit(f"the parts ran different set-ups: {merged['setup']}")
    first = setups[0] if setups else {}
    # Which grid (spec_plan) each of our spec parts ran: "quick" or "full".
    grids = {name: setup.get("grid", "full") for name, setup in merged["setup"].items()
             if setup and name.startswith("ours_spec")}
    config = {"model": first.get("model"), "load_format": "dummy", "prompt_len": first.get("prompt_len"),
              "output_len": first.get("output_len"), "batches": list(batches),
              "ks": list(ks), "grids": grids, "vllm_configs": sorted(merged["vllm"]),
              "greedy": True, "ignore_eos": True, "prefix_caching": False,
              "tpot": "(t(full generate) - t(generate with max_tokens=2)) / (output_len - 2)"}
    baselines = {"vllm": ("0.26 offline, same prompts, lengths and model config" if merged["vllm"]
                          else "not run (no vllm_* parts)")}
    hosts = [h for name, h in sorted(merged.pop("host").items()) if h and not name.startswith("vllm_")]
    targets = targets_of(ratios, batches)
    write_result(output, "spec_decode", None, config, merged, baselines, ratios,
                 device=device or (devices.pop() if devices else None), host=hosts[0] if hosts else None,
                 measured_commit=ours_commits.pop() if ours_commits else None,
                 extra={"targets": targets, "notes": NOTES})
    return {"ratios": ratios, "targets": targets}


def part_path(parts_dir: Path, name: str) -> Path:
    return parts_dir / f"{name}.json"


_HOST: list = []


def _host() -> dict:
    """This machine's host_info(), once a process (write_part runs after every run)."""
    if not _HOST:
        from pagedserve.benchmark.results import host_info
        _HOST.append(host_info())
    return _HOST[0]


def write_part(parts_dir: Path, name: str, results: dict, vllm_side: bool, args) -> None:
    from pagedserve.benchmark.results import git_commit
    import torch
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    parts_dir.mkdir(parents=True, exist_ok=True)
    setup = {"model": Path(args.model).name, "prompt_len": args.prompt_len, "output_len": args.output_len,
             "batches": args.batches, "ks": args.ks, "accepts": args.accepts, "max_model_len": args.max_model_len,
             "grid": args.grid if name.startswith("ours_spec") else None}  # spec_plan's; the others have none
    doc = {"device": device, "commit": "vllm" if vllm_side else git_commit(), "host": _host(), "setup": setup,
           "results": results}
    part_path(parts_dir, name).write_text(json.dumps(doc, indent=1) + "\n")
    out = os.environ.get("OUT")
    if out:
        (Path(out) / "spec_decode_parts").mkdir(parents=True, exist_ok=True)
        (Path(out) / "spec_decode_parts" / f"{name}.json").write_text(json.dumps(doc, indent=1) + "\n")


def tiny_model_dir() -> str:
    """A Llama config small enough for a CPU (dummy weights need nothing but config.json)."""
    cfg = json.loads((Path(MODEL) / "config.json").read_text())
    cfg.update(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, vocab_size=512, max_position_embeddings=1024, torch_dtype="float32",
               bos_token_id=0, eos_token_id=1)
    cfg["rope_scaling"]["original_max_position_embeddings"] = 64
    d = tempfile.mkdtemp(prefix="spec_smoke_")
    (Path(d) / "config.json").write_text(json.dumps(cfg))
    return d


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("section", choices=["ours", "vllm", "collect", "smoke"])
    ap.add_argument("--config", help="ours: off or spec; vllm: off, draft_model_kK, ngram_kK")
    ap.add_argument("--model", default=MODEL, help="a model directory (config.json; dummy weights)")
    ap.add_argument("--batches", default=",".join(map(str, BATCHES)))
    ap.add_argument("--ks", default=",".join(map(str, KS)))
    ap.add_argument("--accepts", default=",".join(f"{a:g}" for a in ACCEPTS))
    ap.add_argument("--grid", choices=GRIDS, default="full", help="ours --config spec: the runs of each batch "
                    "(spec_plan): full, or quick (the acceptance sweep at k = 4 only, k = 1, 2 at a = 1)")
    ap.add_argument("--prompt-len", type=int, default=PROMPT_LEN)
    ap.add_argument("--output-len", type=int, default=OUTPUT_LEN)
    ap.add_argument("--max-model-len", type=int, default=1024)
    # The draft's weights and pools come on top of the target's: leave them room (see draft_model.py).
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.5)
    ap.add_argument("--vllm-gpu-memory-utilization", type=float, default=0.9)
    ap.add_argument("--engine-args", default="{}", help="more LLM(...) keyword arguments for ours, as JSON")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--site", default=None, help="vllm: a directory with vLLM installed (put on sys.path)")
    ap.add_argument("--parts", default=str(PARTS))
    ap.add_argument("--output", default=str(OUTPUT))
    args = ap.parse_args()
    args.batches = [int(b) for b in args.batches.split(",")]
    args.accepts = [float(a) for a in args.accepts.split(",")]
    ks = args.ks = [int(k) for k in args.ks.split(",")]
    parts = Path(args.parts)
    if args.section == "ours":
        name = "ours_off" if args.config == "off" else "ours_spec_b" + "_".join(map(str, args.batches))
        if args.config == "spec" and args.grid != "full":
            name += f"_{args.grid}"
        # The part is rewritten after every run, so a section cut by its time limit keeps its runs.
        write_part(parts, name, ours(args.config, args, checkpoint=lambda res: write_part(
            parts, name, res, vllm_side=False, args=args)), vllm_side=False, args=args)
    elif args.section == "vllm":
        if args.site:
            sys.path.insert(0, args.site)
        name = f"vllm_{args.config}"
        write_part(parts, name, vllm(args.config, args, checkpoint=lambda res: write_part(
            parts, name, res, vllm_side=True, args=args)), vllm_side=True, args=args)
    elif args.section == "collect":
        print(json.dumps(collect(parts, Path(args.output), args.batches, ks), indent=1))
    else:  # smoke: CPU, tiny, everything at once, into --parts / --output under a temp dir by default
        args.device = "cpu"
        args.model = tiny_model_dir()
        args.prompt_len, args.output_len = 16, 8
        args.batches, args.ks, args.accepts = [1, 4], [1, 4], [0.0, 1.0]
        ks = args.ks
        if args.parts == str(PARTS):
            tmp = Path(tempfile.mkdtemp(prefix="spec_smoke_out_"))
            args.parts, args.output = str(tmp / "parts"), str(tmp / "spec_decode.json")
        parts = Path(args.parts)
        write_part(parts, "ours_off", ours("off", args), vllm_side=False, args=args)
        checkpoints = []
        write_part(parts, f"ours_spec_{args.grid}", ours("spec", args, checkpoint=lambda res: checkpoints.append(
            sum(len(runs) for runs in res.values() if isinstance(runs, dict)))), vllm_side=False, args=args)
        assert checkpoints == sorted(checkpoints) and len(checkpoints) == checkpoints[-1], checkpoints
        print(json.dumps(collect(parts, Path(args.output), args.batches, ks, device="cpu"), indent=1))
        print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
