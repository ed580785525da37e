"""One draft-model round in isolation: what DraftModelProposer.propose() costs against the forwards
it runs (issue #36; the engine-level figures are spec_decode_bench.py's).

Set-up: the draft is Llama-3.1-8B's config with dummy weights (bf16, on CUDA with its graphs), k
proposals per request, batches of 1, 8, 32 and 128 requests with 128-token prompts. After a first
round (the prompt's catch-up) every round is a steady-state one: each request's proposals are all
accepted plus a bonus token, so its catch-up is two tokens (the last proposal and the bonus) and
then k - 1 decode steps. Per batch:
  round_ms   median wall time of propose() (it ends with its one read, so the device work is in)
  step_ms    median time of one replay of the draft's decode graph of the batch's bucket alone
             (CUDA events around DecodeCUDAGraphs.replay; present where the checkout has it)
  overhead_ms = round_ms - k * step_ms: what the round costs beyond its k forwards' device time
             (the catch-up's two rows a request make its forward a little dearer than a step)
With --engine, the same batches through the engine (LLM with speculative_config draft_model, draft
= target, k fixed, pausing off; greedy, 128 new tokens), per speculating step:
  step_ms    (t - t2) / (steps - steps2): t the generate's seconds, t2 that of max_tokens=2 (prefill)
  propose_ms the proposer's share (SpecDecodeStats.proposer_seconds: propose() with its one read)
  rest_ms    step_ms - propose_ms: scheduling, the verification's forward and read, appending, output
  acceptance accepted / proposed tokens (draft = target, greedy: should be near 1)
Written as JSON to --out (default $OUT/draft_round.json, else ./draft_round.json).

Runs on any checkout whose DraftModelProposer takes (dir, EngineConfig, num_blocks=...), so the
same script measures main before and after a change:
    timeout 300 python benchmarks/offline/draft_round_bench.py            # CUDA, ~1-2 min
    timeout 420 python benchmarks/offline/draft_round_bench.py --engine   # CUDA, ~3-5 min
    python benchmarks/offline/draft_round_bench.py --smoke                # CPU, tiny config, seconds
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from pagedserve.config import EngineConfig  # noqa: E402
from pagedserve.spec_decode.draft_model import DraftModelProposer  # noqa: E402
from pagedserve.spec_decode.proposer import ProposalRequest  # noqa: E402


def tiny_model_dir() -> str:
    """A tiny Llama config directory (dummy weights), for --smoke."""
    from transformers import LlamaConfig
    d = tempfile.mkdtemp(prefix="draft-round-")
    LlamaConfig(vocab_size=384, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=1024,
                architectures=["LlamaForCausalLM"]).save_pretrained(d)
    return d


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def step_ms(prop: DraftModelProposer, batch: int, repeats: int) -> float | None:
    """Median ms of one replay of the decode graph of batch's bucket (its buffers as the last round left them)."""
    g = prop.graphs
    if g is None or not hasattr(g, "replay") or g.bucket_for(batch) is None:
        return None
    times = []
    for _ in range(repeats):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay(batch)
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def measure(prop: DraftModelProposer, batch: int, k: int, prompt_len: int, rounds: int, device: str) -> dict:
    seq = list(range(batch * 1000, batch * 1000 + batch))
    vocab = min(prop.vocab_size, 10000)
    verified = [[10 + (i * 131 + j * 7) % (vocab - 10) for j in range(prompt_len)] for i in range(batch)]
    times = []
    for r in range(rounds + 1):
        reqs = [ProposalRequest(s, v, k, 0.0, None) for s, v in zip(seq, verified)]
        sync(device)
        t0 = time.perf_counter()
        got = prop.propose(reqs)
        times.append(time.perf_counter() - t0)
        for v, toks in zip(verified, got.token_ids):
            v.extend(toks + [7])  # all accepted, then a bonus token
    for s in seq:
        prop.finish(s)
    round_ms = statistics.median(times[1:]) * 1e3  # round 0 caught up on the prompts
    out = {"batch": batch, "k": k, "round_ms": round(round_ms, 3), "rounds": rounds}
    st = step_ms(prop, batch, 20) if device == "cuda" else None
    if st is not None:
        out.update(step_ms=round(st, 3), overhead_ms=round(round_ms - k * st, 3))
    return out


def engine_section(model: str, batches: list[int], k: int, prompt_len: int, output_len: int, device: str,
                   dtype: str) -> list[dict]:
    from pagedserve import LLM, SamplingParams
    spec = {"method": "draft_model", "model": model, "num_speculative_tokens": k, "min_speculation_yield": 0,
            "spec_disable_batch_tokens": 1 << 30}
    llm = LLM(model, load_format="dummy", skip_tokenizer_init=True, max_model_len=1024, max_num_seqs=max(batches),
              enable_prefix_caching=False, device=device, dtype=dtype, seed=0, speculative_config=spec)
    stats = llm.llm_engine.get_spec_decode_stats()
    vocab = min(llm.llm_engine.hf_config.vocab_size, 10000)
    out = []
    for b in batches:
        prompts = [{"prompt_token_ids": [10 + (i * 131 + j * 7) % (vocab - 10) for j in range(prompt_len)]}
                   for i in range(b)]

        def run(max_tokens):
            before = (stats.num_spec_steps, stats.proposer_seconds, stats.num_draft_tokens, stats.num_accepted_tokens)
            sync(device)
            t0 = time.perf_counter()
            llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True),
                         use_tqdm=False)
            sync(device)
            after = (stats.num_spec_steps, stats.proposer_seconds, stats.num_draft_tokens, stats.num_accepted_tokens)
            return (time.perf_counter() - t0, *(a - c for a, c in zip(after, before)))
        run(8)  # warm-up: first shapes
        t2, steps2, prop2, _, _ = run(2)
        t, steps, prop, drafted, accepted = run(output_len)
        n = max(1, steps - steps2)
        step_ms = (t - t2) / n * 1e3
        propose_ms = (prop - prop2) / n * 1e3
        out.append({"batch": b, "k": k, "spec_steps": steps, "step_ms": round(step_ms, 3),
                    "propose_ms": round(propose_ms, 3), "rest_ms": round(step_ms - propose_ms, 3),
                    "acceptance": round(accepted / drafted, 4) if drafted else None,
                    "tpot_ms": round((t - t2) / (output_len - 2) * 1e3, 3)})
        print(json.dumps(out[-1]), flush=True)
    llm.llm_engine.shutdown()
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=str(ROOT / "benchmarks/models/llama-3.1-8b"))
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 128])
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--smoke", action="store_true", help="CPU, a tiny config, 2 batches")
    ap.add_argument("--engine", action="store_true", help="through the engine instead (see the docstring)")
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    device = "cpu" if args.smoke else "cuda"
    model = tiny_model_dir() if args.smoke else args.model
    batches = [1, 4] if args.smoke else args.batches
    max_len = 1024
    cfg = EngineConfig(model=model, device=device, dtype="float32" if args.smoke else "bfloat16",
                       load_format="dummy", block_size=16, max_num_seqs=max(batches), max_model_len=max_len,
                       skip_tokenizer_init=True, seed=0)
    t0 = time.perf_counter()
    if args.engine:
        results = engine_section(model, batches, args.k, args.prompt_len, 16 if args.smoke else args.output_len,
                                 device, cfg.dtype)
    else:
        prop = DraftModelProposer(model, cfg, num_blocks=max(batches) * max_len // 16)
        results = []
        for b in batches:
            results.append(measure(prop, b, args.k, args.prompt_len, 3 if args.smoke else args.rounds, device))
            print(json.dumps(results[-1]), flush=True)
    start_s = time.perf_counter() - t0
    from pagedserve.benchmark.results import engine_switches, write_result
    name = "draft_engine.json" if args.engine else "draft_round.json"
    path = args.out or os.path.join(os.environ.get("OUT", "."), name)
    config = {"model": os.path.basename(model), "section": "engine" if args.engine else "round", "k": args.k,
              "batches": batches, "prompt_len": args.prompt_len, "rounds": args.rounds, "dtype": cfg.dtype,
              "seconds": round(start_s, 1)}
    write_result(path, Path(name).stem, None, config, {"rows": results}, switches=engine_switches(cfg))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
