"""The pagedserve side: `ours --config off` (speculation off, every batch) and `ours --config spec` (one
engine, draft model = target, whose proposer and policy are switched between runs: spec_plan).

The engine's speculative-decoding state is LLMEngine.speculator (engine/speculation.py): its proposer,
its adaptive policy (k, the batch-token threshold and the yield pause) and its counters.
Weights: the checkpoint in args.weights (load_format auto; the draft is the same directory), or dummy
weights in args.model's config when args.weights is None.
"""
from __future__ import annotations

import gc
import json
import time

from .common import ADAPTIVE_K, FIXED, GRIDS, WARMUP_TOKENS, log, make_prompts, sync, timing

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


def counters(llm) -> tuple[int, int, int, int, int, int]:
    """(proposed, accepted) tokens, paused steps, speculating (synchronous, verifying) steps,
    steps a host-side proposer had nothing for (overlapped) and shadow probes so far, from the
    engine's speculative-decoding counters."""
    s = speculator(llm).stats
    return (int(s.num_draft_tokens), int(s.num_accepted_tokens), int(s.num_paused_steps),
            int(s.num_spec_steps), int(s.num_unproposed_steps), int(s.num_shadow_probes))


class NoProposals:
    """Proposes nothing: the engine decodes one token per step (for the replay's recordings). A
    host-side proposer (spec_decode/proposer.py), as the n-gram over text that does not repeat."""

    proposes_on_host = True

    def has_proposals(self, requests) -> bool:
        return False

    def propose(self, requests):
        from pagedserve.spec_decode.proposer import Proposals
        return Proposals([[] for _ in requests], None)

    def finish(self, seq_id: int) -> None:
        pass


def _generate(llm, prompts, max_tokens: int):
    from pagedserve import SamplingParams
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    sync()
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    sync()
    return time.perf_counter() - t0, [list(o.outputs[0].token_ids) for o in outs]


def measure(llm, prompts, output_len: int, spec: bool, fresh_policy=None) -> dict:
    """TPOT, throughput and (with speculation) the measured acceptance of one batch: an untimed warm-up
    generate of the same batch (WARMUP_TOKENS), then t2 (max_tokens=2) and t (output_len), timed.
    fresh_policy(), when given, runs after the warm-up, so the timed generates start from a new policy
    (no pause the warm-up's steps decided)."""
    warmup, _ = _generate(llm, prompts, WARMUP_TOKENS)
    if fresh_policy is not None:
        fresh_policy()
    t2, _ = _generate(llm, prompts, 2)
    before = counters(llm) if spec else None
    t, outs = _generate(llm, prompts, output_len)
    res = timing(t, t2, warmup, outs, output_len)
    if spec:
        proposed, accepted, paused, spec_steps, unproposed, shadow = (a - b for a, b in zip(counters(llm), before))
        res.update(proposed_tokens=proposed, accepted_tokens=accepted, paused_steps=paused,
                   spec_steps=spec_steps, unproposed_steps=unproposed, shadow_probes=shadow,
                   acceptance_rate=round(accepted / proposed, 4) if proposed else None)
    return res


def build_llm(args, spec: dict | None):
    """Our LLM on args.weights (load_format auto) or on dummy weights in args.model's config."""
    from pagedserve import LLM
    model = args.weights or args.model
    kw = dict(load_format="auto" if args.weights else "dummy", skip_tokenizer_init=True,
              max_model_len=args.max_model_len, seed=0, max_num_seqs=max(args.batches),
              enable_prefix_caching=False, device=args.device)
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


def ours(config: str, args, on_run=None) -> dict:
    """One `ours` section: {"bB": {run name: measure()}} for each batch of args.batches.
    config "off": one run per batch. config "spec": one engine (draft model = target, k = max(ks, ADAPTIVE_K))
    whose proposer and policy are switched between runs, spec_plan(args.grid) at every batch, a tier at
    a time (tier 0 at every batch, then tier 1). on_run(results), when given, is called after every
    run with what is measured so far. Each run (configuration and batch) starts with its own warm-up
    generate (measure)."""
    from pagedserve.spec_decode.config import DEFAULT_DISABLE_BATCH_TOKENS, DEFAULT_MIN_SPECULATION_YIELD
    from pagedserve.spec_decode.ngram import NgramProposer
    from pagedserve.spec_decode.synthetic import AcceptanceControlledProposer, ReplayProposer

    spec = None
    if config == "spec":  # the draft: the target's own directory (its checkpoint, or its config for dummy)
        spec = {"method": "draft_model", "model": args.weights or args.model,
                "num_speculative_tokens": max(args.ks + [ADAPTIVE_K]), "spec_disable_batch_tokens": FIXED}
    elif config != "off":
        raise SystemExit(f"ours: --config must be off or spec, got {config!r}")
    plan = spec_plan(args.grid, args.ks, args.accepts) if spec is not None else []
    t0 = time.perf_counter()
    llm = build_llm(args, spec)
    log(f"ours {config}: engine up in {time.perf_counter() - t0:.1f} s")
    vocab = llm.llm_engine.vocab_size
    results: dict = {"engine_seconds": round(time.perf_counter() - t0, 1)}
    prompts = {b: make_prompts(b, args.prompt_len, vocab) for b in args.batches}
    if spec is None:
        for b in args.batches:
            results[f"b{b}"] = {"off": measure(llm, prompts[b], args.output_len, spec=False)}
            log(f"ours off b{b}: {results[f'b{b}']['off']}")
            if on_run is not None:
                on_run(results)
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
                policy = adaptive if is_adaptive else (FIXED, 0.0)
                set_policy(llm, k, *policy)
                results[f"b{b}"][name] = measure(llm, prompts[b], args.output_len, spec=True,
                                                 fresh_policy=lambda: set_policy(llm, k, *policy))
                log(f"ours spec b{b} {name}: {results[f'b{b}'][name]}")
                if on_run is not None:
                    on_run(results)
    set_proposer(llm, draft)
    free(llm)
    return results

