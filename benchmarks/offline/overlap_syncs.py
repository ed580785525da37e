"""Where an overlapped step waits for the GPU: the host syncs of a serving loop, counted by place.

An overlapped step (EngineConfig.async_scheduling) is meant to wait for the device once, for the
previous step's tokens (AsyncHostCopy: an event on a side stream). Any other synchronizing CUDA
call in the loop (a .item(), a pageable copy, torch.tensor(list, device="cuda"), nonzero) stalls
the host until the GPU drains, and the step loses its overlap: on the H200 a synchronous step
costs 1.21-1.41x an overlapped one. This runs LLMEngine.step() over a mix of requests with
torch.cuda.set_sync_debug_mode("warn") and counts each warning by the innermost pagedserve frame
that made it, so a regression (or an old leak) names its line. Each request kind runs alone first
(--kinds), then all together.

    timeout 300 python benchmarks/offline/overlap_syncs.py --output $OUT/overlap_syncs.json   # CUDA, ~1-2 min

Kinds: plain greedy, seeded top-k/top-p, logprobs=5, penalties (repetition, frequency, presence),
min_tokens; "control" is one known sync alone (an .item()), which must count 1. The JSON holds, per kind, the steps run and {"file:line function": count} of the
syncs outside the warm-up. Not a test: the counts are what the loop does today, to read.
"""
from __future__ import annotations

import argparse
import collections
import os
import sys
import traceback
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

KINDS = {
    "greedy": dict(temperature=0.0),
    "topk_topp_seeded": dict(temperature=0.8, top_k=50, top_p=0.9, seed=3),
    "logprobs": dict(temperature=0.0, logprobs=5),
    "penalties": dict(temperature=0.0, repetition_penalty=1.1, frequency_penalty=0.3, presence_penalty=0.2),
    "min_tokens": dict(temperature=0.0, min_tokens=48),
}


def place(stack: list[traceback.FrameSummary]) -> str:
    """The innermost frame in pagedserve (else the innermost frame) of a warning's stack."""
    ours = [f for f in stack if "/pagedserve/" in f.filename]
    f = (ours or stack)[-1]
    return f"{os.path.relpath(f.filename, ROOT)}:{f.lineno} {f.name}"


def run_kind(llm, params_list, prompts, control: bool = False) -> dict:
    """Step the engine over these requests, counting sync warnings by place. control: first make
    one known sync (.item() of a CUDA tensor) under the same recording, so that a count of 0
    cannot come from a detector that hears nothing (results["control"] must show it)."""
    import torch
    engine = llm.llm_engine
    for i, (p, prompt) in enumerate(zip(params_list, prompts)):
        engine.add_request(f"r{i}", {"prompt_token_ids": prompt}, p)
    counts: collections.Counter = collections.Counter()
    steps = 0
    original = warnings.showwarning

    def record(message, category, filename, lineno, file=None, line=None):
        if "synchroniz" in str(message):
            counts[place(traceback.extract_stack()[:-1])] += 1
        else:
            original(message, category, filename, lineno, file, line)
    warnings.showwarning = record
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.showwarning = record
            if control:
                torch.ones(1, device=engine.device).sum().item()
            while engine.has_unfinished_requests():
                engine.step()
                steps += 1
    finally:
        torch.cuda.set_sync_debug_mode(0)
        warnings.showwarning = original
    return {"steps": steps, "syncs": dict(counts.most_common()), "syncs_total": sum(counts.values())}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=str(ROOT / "benchmarks/models/llama-3.1-8b"))
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--kinds", nargs="+", default=list(KINDS))
    ap.add_argument("--output", default=None)
    args = ap.parse_args()

    from pagedserve import LLM, SamplingParams
    from pagedserve.benchmark.results import write_result
    llm = LLM(args.model, load_format="dummy", skip_tokenizer_init=True, max_model_len=1024,
              max_num_seqs=max(args.batch * len(args.kinds), args.batch), enable_prefix_caching=False, seed=0)
    vocab = llm.llm_engine.hf_config.vocab_size
    prompts = [[10 + (i * 131 + j * 7) % (vocab - 10) for j in range(args.prompt_len)]
               for i in range(args.batch * len(args.kinds))]
    # Warm-up: every kind once, outside the count (first uses allocate and compile).
    for kind in args.kinds:
        warm = KINDS[kind].get("min_tokens", 0) + 4  # min_tokens must stay <= max_tokens
        run_kind(llm, [SamplingParams(max_tokens=warm, ignore_eos=True, **KINDS[kind])], prompts[:1])
    results = {"control": run_kind(llm, [], [], control=True)}  # one .item(): must count 1
    for kind in args.kinds:
        params = [SamplingParams(max_tokens=args.max_tokens, ignore_eos=True, **KINDS[kind])] * args.batch
        results[kind] = run_kind(llm, params, prompts[:args.batch])
        print(kind, results[kind], flush=True)
    mixed = [SamplingParams(max_tokens=args.max_tokens, ignore_eos=True, **KINDS[k]) for k in args.kinds
             for _ in range(args.batch)]
    results["all_kinds_together"] = run_kind(llm, mixed, prompts)
    print("all_kinds_together", results["all_kinds_together"], flush=True)
    llm.llm_engine.shutdown()
    if args.output:
        config = {"model": os.path.basename(args.model), "batch": args.batch, "prompt_len": args.prompt_len,
                  "max_tokens": args.max_tokens, "kinds": {k: KINDS[k] for k in args.kinds}}
        write_result(args.output, "overlap_syncs", None, config, results)


if __name__ == "__main__":
    main()
