"""What a constrained request costs the host per step, and what a grammar costs to compile.

The engine's own pieces: StructuredOutputs compiles the 50 benchmark schemas
(pagedserve/benchmark/json_schemas.py) on its pool (compile seconds p50 / p99, uncached: the first
compile of each schema, and cached: the same spec again, the engine's cache hit). Then, for each
--batches size, that many constrained sequences decode side by side for --steps steps, every row
of the batch constrained, as an overlapped engine step runs them (engine/token_application.py):

  accept_fill  the matchers take the token the previous step sampled (still in flight: `pending`),
               and the host bitmask rows are filled
  apply        the rows go to --device and xgrammar masks a [batch, vocab] logits tensor; host
               time until the call returns (what the step's critical path pays: nothing waits
               for the device), and separately the time until the device has finished
               (`apply_synced`; on the CPU it is xgrammar's CPU kernel, far slower than a GPU's)
  ended        after the token is appended, the constrained rows are checked for a closed grammar
  host         accept_fill + ended; total: host + apply

Each is timed twice on the same walk: `after` runs this checkout's engine code
(TokenApplication._grammar_rows, StructuredOutputs.advance_and_fill and apply,
TokenApplication._grammar_ended),
`before` the code these replaced (commit 43b579e, copied below: a catch_up call per row,
xgrammar's BatchGrammarMatcher with its own threads started on every call, an upload allocated per
step and the indices as a list, the done check asked of xgrammar per row). Both matcher sets take
the same tokens, drawn uniformly from what the mask allows, so the walk visits strings, numbers,
keys and closing brackets alike; a sequence whose grammar closes starts over. The first
--warmup steps (Triton's compile) are left out. Microseconds per step, min / p50 / p99 / mean.

  python benchmarks/kernels/structured_mask_cost.py --tokenizer DIR                  # CPU
  python benchmarks/kernels/structured_mask_cost.py --tokenizer DIR --device cuda --output $OUT/mask.json
DIR: a tokenizer directory; benchmarks/serving/make_bpe_model_dir.py builds the 128k byte-level BPE
the serving benchmark uses (the demo model's 2048 tokens are the default).

--fill-compare: instead, who fills the masks (the host alone, no device). At each --batches size
the rows walk together as above and each step's masks are filled each way on the same matcher
states, in rotating order: `serial` (one BatchGrammarMatcher(1) call in this thread),
`xgrammar` (BatchGrammarMatcher(--fill-threads): its threads started and joined in every call,
the engine's default from 8 rows) and `pool_cN` (engine/structured/fill_pool.py, --fill-threads
threads started once, N chunks a thread, per --pool-chunks: PAGEDSERVE_GRAMMAR_FILL_POOL=1 uses
CHUNKS_PER_THREAD). Each step checks every mask is bit-identical to the serial one. Reported: ms
per step, min / p50 / p99 / mean, and the p50 ratios. On the H200 host (16 cores, 8 fill
threads by default), with the serving run's whitespace bound, building the BPE first if needed
(2 cores here: 150 steps took ~2 minutes with the compiles):

  timeout 590 bash -c 'test -f /tmp/bpe/tokenizer.json || python benchmarks/serving/make_bpe_model_dir.py \\
      benchmarks/models/llama-3.1-8b /tmp/bpe; python benchmarks/kernels/structured_mask_cost.py \\
      --tokenizer /tmp/bpe --fill-compare --batches 16,64,128,256 --steps 200 --max-whitespace 0 \\
      --output $OUT/fill_compare.json'
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch
import xgrammar as xgr

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # this checkout's pagedserve

from pagedserve.benchmark.json_schemas import benchmark_schemas  # noqa: E402
from pagedserve.benchmark.results import write_result  # noqa: E402
from pagedserve.demo_model import DEMO_MODEL_DIR  # noqa: E402
from pagedserve.engine.input_processor import load_tokenizer  # noqa: E402
from pagedserve.engine.structured import StructuredOutputs  # noqa: E402
from pagedserve.engine.structured.fill_pool import CHUNKS_PER_THREAD, FillPool  # noqa: E402
from pagedserve.engine.structured.masks import default_fill_threads  # noqa: E402
from pagedserve.engine.token_application import TokenApplication  # noqa: E402
from pagedserve.sampling_params import StructuredOutputsParams  # noqa: E402
from pagedserve.sequence import SequenceStatus  # noqa: E402

PARTS = ("accept_fill", "apply", "ended", "host", "total", "apply_synced")


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def _summary(xs: list[float], scale: float) -> dict:
    """min too: on a shared, noisy host the least a step took is the figure other processes
    disturb least."""
    return {"min": round(min(xs) * scale, 3), "p50": round(_pct(xs, 0.5) * scale, 3),
            "p99": round(_pct(xs, 0.99) * scale, 3), "mean": round(statistics.fmean(xs) * scale, 3)}


# ---- the code this replaced (commit 43b579e), kept here to be timed beside it ------------------

class OldSeqGrammar:
    def __init__(self, matcher):
        self.matcher, self.num_accepted, self.rejected = matcher, 0, False

    def catch_up(self, output_token_ids, pending=None):
        n = len(output_token_ids)
        while self.num_accepted < n:
            self._accept(output_token_ids[self.num_accepted])
        if pending is not None and self.num_accepted == n:
            self._accept(pending)

    def _accept(self, token):
        self.num_accepted += 1
        if self.rejected or self.matcher.is_terminated():
            return
        if not self.matcher.accept_token(token):
            self.rejected = True

    @property
    def done(self):
        return self.rejected or self.matcher.is_terminated()


class OldPath:
    """_grammar_rows + StructuredOutputs.fill / apply + _grammar_ended as they were."""

    def __init__(self, vocab: int, device: torch.device):
        self.vocab, self.device = vocab, device
        self.by_seq: dict[int, OldSeqGrammar] = {}
        self._buffers: list[torch.Tensor] = []
        self._batch_matcher = None
        self._flip = 0

    def rows(self, sampled, prev):
        pending = None
        if prev is not None:
            def pending(seq):
                if not seq.num_inflight_tokens:
                    return None
                return prev.copy.result().token_ids[seq.inflight_sample_row]
        grammar_of = self.by_seq.get
        rows = []
        for i, s in enumerate(sampled):
            g = grammar_of(s.seq.seq_id)
            if g is not None:
                g.catch_up(s.seq.output_token_ids, None if pending is None else pending(s.seq))
                rows.append((i, g))
        return rows

    def _buffer(self, rows):
        words = xgr.get_bitmask_shape(1, self.vocab)[1]
        if not self._buffers or self._buffers[0].shape[0] < rows:
            cap = max(rows, 2 * (self._buffers[0].shape[0] if self._buffers else 8))
            pin = self.device.type == "cuda"
            self._buffers = [torch.empty((cap, words), dtype=torch.int32, pin_memory=pin) for _ in range(2)]
        self._flip ^= 1
        return self._buffers[self._flip]

    def fill(self, rows):
        if not rows:
            return None
        bitmask = self._buffer(max(i for i, _ in rows) + 1)
        live = [(i, g) for i, g in rows if not g.done]
        if len(live) >= 8:
            if self._batch_matcher is None:
                self._batch_matcher = xgr.BatchGrammarMatcher()
            indices = [i for i, _ in live]
            self._batch_matcher.batch_fill_next_token_bitmask([g.matcher for _, g in live], bitmask, indices)
            return bitmask, indices
        indices = [i for i, g in live if g.matcher.fill_next_token_bitmask(bitmask, i)]
        return (bitmask, indices) if indices else None

    def apply(self, logits, filled):
        if filled is None:
            return
        bitmask, indices = filled
        mask = bitmask[:max(indices) + 1]
        if logits.device.type != "cpu":
            mask = mask.to(logits.device, non_blocking=True)
        xgr.apply_token_bitmask_inplace(logits, mask, vocab_size=min(self.vocab, logits.shape[-1]), indices=indices)

    def ended(self, seqs):
        out = []
        for seq in seqs:
            g = self.by_seq.get(seq.seq_id)
            if g is None:
                continue
            g.catch_up(seq.output_token_ids)
            if g.done and not seq.status.finished:
                out.append(seq)
        return out


# ---- the walk --------------------------------------------------------------------------------

def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def _draw(rng, bitmask_row: torch.Tensor, vocab: int) -> int:
    """A token the row allows, uniformly: a few random probes, else the whole row unpacked."""
    words = bitmask_row.tolist()
    for _ in range(64):
        t = rng.randrange(vocab)
        if (words[t >> 5] >> (t & 31)) & 1:
            return t
    bits = ((bitmask_row[:, None] >> torch.arange(32, dtype=torch.int32)) & 1).reshape(-1)[:vocab]
    return rng.choice(bits.nonzero().flatten().tolist())


def run_batch(so: StructuredOutputs, compiled: list, batch: int, steps: int, warmup: int, device: torch.device,
              seed: int) -> dict:
    vocab = so.vocab_size
    old = OldPath(vocab, device)
    engine = SimpleNamespace(structured=so)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    logits = {k: torch.zeros(batch, vocab, device=device, dtype=dtype) for k in ("before", "after")}
    rng = random.Random(seed)
    seqs = []
    next_id = [0]

    def fresh(row):
        sid = next_id[0] = next_id[0] + 1
        k = rng.randrange(len(compiled))
        so.seqs.start(sid, compiled[k])
        old.by_seq[sid] = OldSeqGrammar(xgr.GrammarMatcher(compiled[k]))
        seq = SimpleNamespace(seq_id=sid, output_token_ids=[], num_inflight_tokens=0, inflight_sample_row=row,
                              status=SequenceStatus.RUNNING)
        return SimpleNamespace(seq=seq)
    seqs = [fresh(r) for r in range(batch)]
    times = {k: {p: [] for p in PARTS} for k in ("before", "after")}
    prev = None  # the previous step's tokens: sampled, in flight, not appended yet
    restarts = 0
    for step in range(steps + warmup):
        keep = step >= warmup
        # This step's mask: the matchers take the previous step's tokens, then fill and apply.
        # Which path goes first alternates: the second finds the caches warmed by the first.
        for key in (("before", "after") if step % 2 else ("after", "before")):
            t0 = time.perf_counter()
            if key == "after":
                mask = so.advance_and_fill(TokenApplication._grammar_rows(engine, seqs, prev))
                t1 = time.perf_counter()
                so.apply(logits[key], mask)
                host_mask = None if mask is None else mask.bitmask
            else:
                mask = old.fill(old.rows(seqs, prev))
                t1 = time.perf_counter()
                old.apply(logits[key], mask)
            t2 = time.perf_counter()
            _sync(device)
            t3 = time.perf_counter()
            if keep:
                t = times[key]
                t["accept_fill"].append(t1 - t0)
                t["apply"].append(t2 - t1)
                t["apply_synced"].append(t3 - t1)
        # This step's tokens, drawn from the mask (a closed grammar's row is discarded: 0).
        tokens = [0 if so.seqs.get(s.seq.seq_id).done else _draw(rng, host_mask[i], vocab)
                  for i, s in enumerate(seqs)]
        # Then the previous step's tokens are appended and the rows checked for a closed grammar.
        if prev is not None:
            for s in seqs:
                if s.seq.num_inflight_tokens:
                    s.seq.output_token_ids.append(prev.token_ids[s.seq.inflight_sample_row])
                    s.seq.num_inflight_tokens = 0
        closed = None
        for key in (("before", "after") if step % 2 else ("after", "before")):
            t0 = time.perf_counter()
            if key == "after":
                ended = [seq for seq, _ in TokenApplication._grammar_ended(engine, [s.seq for s in seqs])]
            else:
                ended = old.ended([s.seq for s in seqs])
            if keep:
                times[key]["ended"].append(time.perf_counter() - t0)
            ids = {seq.seq_id for seq in ended}
            assert closed is None or ids == closed, "the two paths disagree on closed grammars"
            closed = ids
        for r, s in enumerate(seqs):
            if s.seq.seq_id in closed:
                restarts += 1
                so.seqs.free(s.seq.seq_id)
                old.by_seq.pop(s.seq.seq_id)
                seqs[r] = fresh(r)
            else:
                s.seq.num_inflight_tokens = 1
                s.seq.inflight_sample_row = r
        step_ids = SimpleNamespace(token_ids=tokens)
        prev = SimpleNamespace(copy=SimpleNamespace(result=lambda ids=step_ids: ids), token_ids=tokens)
        if keep:
            for t in times.values():
                t["host"].append(t["accept_fill"][-1] + t["ended"][-1])
                t["total"].append(t["host"][-1] + t["apply"][-1])
    out = {key: {f"{p}_us_per_step": _summary(times[key][p], 1e6) for p in PARTS} for key in times}
    out["grammars_closed_and_restarted"] = restarts
    for part in ("host", "total"):
        out[f"{part}_p50_after_over_before"] = round(out["after"][f"{part}_us_per_step"]["p50"]
                                                     / out["before"][f"{part}_us_per_step"]["p50"], 3)
    return out


def compare_fills(compiled: list, vocab: int, batch: int, steps: int, warmup: int, threads: int,
                  pool_chunks: list[int], seed: int) -> dict:
    """--fill-compare at one batch size: ms per step of each filler, on the same walk."""
    rng = random.Random(seed)
    fill = {"serial": xgr.BatchGrammarMatcher(1).batch_fill_next_token_bitmask,
            "xgrammar": xgr.BatchGrammarMatcher(threads).batch_fill_next_token_bitmask}
    pools = [FillPool(threads, c) for c in pool_chunks]
    for c, pool in zip(pool_chunks, pools):
        fill[f"pool_c{c}"] = pool.fill
    fillers = tuple(fill)
    words = xgr.get_bitmask_shape(1, vocab)[1]
    masks = {k: torch.zeros(batch, words, dtype=torch.int32) for k in fillers}

    def fresh():
        return xgr.GrammarMatcher(compiled[rng.randrange(len(compiled))])
    matchers = [fresh() for _ in range(batch)]
    rows = list(range(batch))
    times = {k: [] for k in fillers}
    restarts = 0
    try:
        for step in range(steps + warmup):
            r = step % len(fillers)
            order = fillers[r:] + fillers[:r]  # who runs first (colder caches) rotates
            for k in order:
                t0 = time.perf_counter()
                fill[k](matchers, masks[k], rows)
                if step >= warmup:
                    times[k].append(time.perf_counter() - t0)
            for k in fillers[1:]:
                assert torch.equal(masks[k], masks["serial"]), f"{k} filled other masks than the serial fill"
            for r, m in enumerate(matchers):
                m.accept_token(_draw(rng, masks["serial"][r], vocab))
                if m.is_terminated():
                    matchers[r] = fresh()
                    restarts += 1
    finally:
        for pool in pools:
            pool.close()
    out = {f"{k}_ms_per_step": _summary(times[k], 1e3) for k in fillers}
    p50 = {k: out[f"{k}_ms_per_step"]["p50"] for k in fillers}
    for k in fillers[1:]:
        out[f"{k}_over_serial_p50"] = round(p50[k] / p50["serial"], 3)
        if k != "xgrammar":
            out[f"{k}_over_xgrammar_p50"] = round(p50[k] / p50["xgrammar"], 3)
    out["grammars_closed_and_restarted"] = restarts
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokenizer", default=str(DEMO_MODEL_DIR), help="HF tokenizer directory")
    p.add_argument("--vocab-size", type=int, default=None, help="the model's (padded) vocab; default len(tokenizer)")
    p.add_argument("--batches", default="64,128,256", help="constrained rows per step, comma-separated")
    p.add_argument("--steps", type=int, default=64)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--device", default="cpu")
    p.add_argument("--fill-threads", type=int, default=None, help="StructuredOutputs' fill threads (default: its own)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-whitespace", type=int, default=None,
                   help="bound on free JSON whitespace (structured_outputs_max_whitespace; default the engine's)")
    p.add_argument("--fill-compare", action="store_true",
                   help="time serial / xgrammar threads / FillPool fills instead (see the docstring)")
    p.add_argument("--pool-chunks", default=f"1,{CHUNKS_PER_THREAD}",
                   help="--fill-compare: a FillPool per value of chunks per thread (the engine's: "
                        f"{CHUNKS_PER_THREAD})")
    p.add_argument("--output", default=None, help="result JSON (benchmark/results.py format, with a .md beside)")
    args = p.parse_args()

    tok = load_tokenizer(args.tokenizer)
    vocab = args.vocab_size or len(tok)
    device = torch.device(args.device)
    ws = {} if args.max_whitespace is None else {"max_whitespace": args.max_whitespace}
    so = StructuredOutputs(tok, vocab, {tok.eos_token_id}, device, fill_threads=args.fill_threads, **ws)
    specs = [StructuredOutputsParams(json=s) for s in benchmark_schemas()]

    uncached, cached, compiled = [], [], []
    for spec in specs:
        for times in (uncached, cached):
            t0 = time.perf_counter()
            compiled.append(so.pool.submit(spec.key(), so.check(spec)).result())
            times.append(time.perf_counter() - t0)
    compiled = compiled[::2]

    results = {"compile_ms_uncached": _summary(uncached, 1e3), "compile_ms_cached": _summary(cached, 1e3)}
    threads = args.fill_threads or default_fill_threads()
    if args.fill_compare:
        so.shutdown()
        if threads < 2:
            raise SystemExit(f"--fill-compare needs --fill-threads >= 2 (this machine's default is {threads})")
        batches = [int(b) for b in args.batches.split(",")]
        pool_chunks = [int(c) for c in args.pool_chunks.split(",")]
        for batch in batches:
            results[f"batch_{batch}"] = r = compare_fills(compiled, vocab, batch, args.steps, args.warmup, threads,
                                                          pool_chunks, args.seed)
            print(batch, {k[:-len("_ms_per_step")]: v["p50"] for k, v in r.items() if k.endswith("_ms_per_step")},
                  file=sys.stderr, flush=True)
        config = {"tokenizer": args.tokenizer, "vocab_size": vocab, "batches": args.batches, "steps": args.steps,
                  "warmup": args.warmup, "schemas": len(specs), "fill_threads": threads, "pool_chunks": pool_chunks,
                  "max_whitespace": so.max_whitespace, "cpus": len(os.sched_getaffinity(0))}
        print(json.dumps({"config": config, "results": results}, indent=1))
        if args.output:
            ratios = {f"{k}_b{b}": v for b in batches for k, v in results[f"batch_{b}"].items()
                      if k.endswith("_p50")}
            write_result(args.output, "structured_fill_compare", None, config, results, ratios=ratios, device="cpu")
        return
    for batch in (int(b) for b in args.batches.split(",")):
        results[f"batch_{batch}"] = run_batch(so, compiled, batch, args.steps, args.warmup, device, args.seed)
    so.shutdown()
    info = Path(args.tokenizer) / "bpe_info.json"  # make_bpe_model_dir.py's record of what it trained
    config = {"tokenizer": args.tokenizer, "vocab_size": vocab,
              "tokenizer_info": json.loads(info.read_text()) if info.exists() else None,
              "batches": args.batches, "steps": args.steps, "warmup": args.warmup, "schemas": len(specs),
              "fill_threads": args.fill_threads or default_fill_threads(), "logits_dtype": "bfloat16" if device.type == "cuda" else "float32"}
    print(json.dumps({"config": config, "results": results}, indent=1))
    if args.output:
        ratios = {f"{part}_p50_after_over_before_b{b}": results[f"batch_{b}"][f"{part}_p50_after_over_before"]
                  for b in args.batches.split(",") for part in ("host", "total")}
        write_result(args.output, "structured_mask_cost", None, config, results, ratios=ratios,
                     device=torch.cuda.get_device_name() if device.type == "cuda" else "cpu")


if __name__ == "__main__":
    main()
