"""Speculative decoding: TPOT and throughput against acceptance rate and k, beside speculation off,
the adaptive policy, and vLLM 0.26 in the same set-up (issue #36).

Set-up, both engines alike: Llama-3.1-8B's config, bf16, greedy, ignore_eos, prefix caching off;
each prompt PROMPT_LEN ids (a random passage of PROMPT_LEN / 2 ids written twice: copy-heavy, so
n-gram lookup has something to find), OUTPUT_LEN new tokens; batches of 1, 8, 32 and 128 requests
submitted at once. Weights: with --weights DIR, the one checkpoint the `checkpoint` section wrote
there (HF layout, HF's own seeded init: spec_bench/weights.py), loaded by both engines (load_format
auto), and the draft model of the draft configs is that same DIR on both sides; without it, each
engine's dummy weights (not the same model on the two sides: vLLM's uniform +-1e-3 init makes
degenerate repeating text, ours varied text), so collect sets no vLLM part against ours then. Each
part records its weights (dir, source config, seed, sha256 of config.json and of the first shard's
first MiB, or "dummy"), and collect refuses to merge our parts of different weights.
Per (config, batch): first an untimed warm-up generate of the same batch (max_tokens=2), so lazy
first-call work at that shape is not timed (vLLM's first generate of a draft config at batch 1 took
1.2 s for 2 tokens, which made its TPOT negative); then t2 = seconds of a generate with max_tokens=2
(prefill, first token and one decode step; 2 rather than 1 since an early version of our engine
with speculation on lost max_tokens=1 requests, fixed and tested since in
tests/spec_decode/test_spec_engine.py: kept at 2 so figures stay comparable across runs), and
t = seconds of the full generate; TPOT = (t - t2) / (OUTPUT_LEN - 2) and throughput = batch *
OUTPUT_LEN / t (output tokens/s). The warm-up's seconds are kept beside them (warmup_seconds).

Sections, each one process that fits a 10-minute device call (benchmarks/spec_h200.sh runs them):
  checkpoint --weights DIR  writes --model's config as a safetensors checkpoint in DIR (which must not
                           exist; on the GPU when there is one; --seed, default 0). 8B: 16 GB
  ours --config off        speculation off (no speculative_config): the baseline, every batch
  ours --config spec --batches B   one engine with speculative_config draft_model, draft = target (the
                           same directory: its greedy proposals are the target's, up to bf16 rounding),
                           whose proposer and policy are switched between runs (LLMEngine.speculator):
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
                           says which grid each part ran, `targets` the issue's targets against the figures,
                           config.vllm_compared which vLLM parts ran our checkpoint (the only ones in ratios)
  plot                     draws --output's figures (TPOT and throughput against acceptance and k, every
                           batch; spec_bench/plot.py) into --figure (docs/figures/h200_spec_decode.png)
  smoke                    CPU, a tiny config: checkpoint, both `ours` sections with --weights on it, and
                           collect in one process (--grid too; --weights DIR to keep the checkpoint)
Acceptance is measured (accepted / proposed tokens, from the engine's counters) beside the a
that was asked for: with corruption probability 1 - a per token, greedy verification accepts
proposal j with probability a**j.

The sides live in spec_bench/ (common, weights, ours, vllm_side, collect); this file is the command line.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # spec_bench, also when loaded by path (tests)
from spec_bench.collect import collect, merge_parts, ratios_of, targets_of  # noqa: E402,F401
from spec_bench.common import (ACCEPTS, BATCHES, GRIDS, KS, MODEL, OUTPUT, PARTS, PROMPT_LEN,  # noqa: E402
                               OUTPUT_LEN, ROOT, log, make_prompts)  # noqa: F401
from spec_bench.ours import ours, spec_plan  # noqa: E402,F401
from spec_bench.weights import weights_record, write_checkpoint  # noqa: E402

sys.path.insert(0, str(ROOT))


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
    """One section's part file (rewritten after every run), with the weights it ran (args.record:
    weights_record, computed once a section)."""
    from pagedserve.benchmark.results import git_commit
    import torch
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    parts_dir.mkdir(parents=True, exist_ok=True)
    setup = {"model": args.record["model"], "prompt_len": args.prompt_len, "output_len": args.output_len,
             "batches": args.batches, "ks": args.ks, "accepts": args.accepts, "max_model_len": args.max_model_len,
             "grid": args.grid if name.startswith("ours_spec") else None}  # spec_plan's; the others have none
    doc = {"device": device, "commit": "vllm" if vllm_side else git_commit(), "host": _host(), "setup": setup,
           "weights": args.record, "results": results}
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


def smoke(args) -> None:
    """CPU, tiny: checkpoint -> ours off and ours spec (--grid) on it -> collect, into --parts / --output
    (under a temp dir by default)."""
    args.device = "cpu"
    args.model = tiny_model_dir()
    args.prompt_len, args.output_len = 16, 8
    args.batches, args.ks, args.accepts = [1, 4], [1, 4], [0.0, 1.0]
    if args.parts == str(PARTS):
        tmp = Path(tempfile.mkdtemp(prefix="spec_smoke_out_"))
        args.parts, args.output = str(tmp / "parts"), str(tmp / "spec_decode.json")
    args.weights = args.weights or str(Path(args.model) / "checkpoint")  # removed with the config below
    try:
        log(f"checkpoint: {write_checkpoint(args.model, args.weights, seed=args.seed, device='cpu')}")
        args.record = weights_record(args.weights, args.model)
        parts = Path(args.parts)
        write_part(parts, "ours_off", ours("off", args), vllm_side=False, args=args)
        runs = []
        write_part(parts, f"ours_spec_{args.grid}", ours("spec", args, on_run=lambda res: runs.append(
            sum(len(r) for r in res.values() if isinstance(r, dict)))), vllm_side=False, args=args)
        assert runs == sorted(runs) and len(runs) == runs[-1], runs  # on_run after each run, with it in
        print(json.dumps(collect(parts, Path(args.output), args.batches, args.ks, device="cpu"), indent=1))
        print(f"wrote {args.output}")
    finally:
        shutil.rmtree(args.model, ignore_errors=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("section", choices=["checkpoint", "ours", "vllm", "collect", "plot", "smoke"])
    ap.add_argument("--config", help="ours: off or spec; vllm: off, draft_model_kK, ngram_kK")
    ap.add_argument("--model", default=MODEL, help="a model directory (config.json): the checkpoint's config, "
                    "or the config of the dummy weights without --weights")
    ap.add_argument("--weights", default=None, help="checkpoint: the directory to write; ours, vllm: the "
                    "checkpoint both engines load (and the draft model); without it, dummy weights")
    ap.add_argument("--seed", type=int, default=0, help="checkpoint: the init's seed")
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
    ap.add_argument("--figure", default=str(ROOT / "docs/figures/h200_spec_decode.png"))
    args = ap.parse_args()
    args.batches = [int(b) for b in args.batches.split(",")]
    args.accepts = [float(a) for a in args.accepts.split(",")]
    args.ks = [int(k) for k in args.ks.split(",")]
    parts = Path(args.parts)
    if args.section in ("ours", "vllm"):
        args.record = weights_record(args.weights, args.model)
        log(f"{args.section} {args.config}: weights {args.record}")
    if args.section == "checkpoint":
        if not args.weights:
            raise SystemExit("checkpoint: --weights DIR (the directory to write) is required")
        log(f"checkpoint: {json.dumps(write_checkpoint(args.model, args.weights, args.seed, args.device))}")
    elif args.section == "ours":
        name = "ours_off" if args.config == "off" else "ours_spec_b" + "_".join(map(str, args.batches))
        if args.config == "spec" and args.grid != "full":
            name += f"_{args.grid}"
        # The part is rewritten after every run, so a section cut by its time limit keeps its runs.
        write_part(parts, name, ours(args.config, args, on_run=lambda res: write_part(
            parts, name, res, vllm_side=False, args=args)), vllm_side=False, args=args)
    elif args.section == "vllm":
        if args.site:
            sys.path.insert(0, args.site)
        from spec_bench.vllm_side import vllm
        name = f"vllm_{args.config}"
        write_part(parts, name, vllm(args.config, args, on_run=lambda res: write_part(
            parts, name, res, vllm_side=True, args=args)), vllm_side=True, args=args)
    elif args.section == "collect":
        print(json.dumps(collect(parts, Path(args.output), args.batches, args.ks), indent=1))
    elif args.section == "plot":
        from spec_bench.plot import plot
        plot(json.loads(Path(args.output).read_text()), Path(args.figure))
        log(f"plot: wrote {args.figure}")
    else:
        smoke(args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
