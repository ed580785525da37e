"""Summarise an engine core's step trace (PAGEDSERVE_STEP_TRACE, pagedserve/engine/step_trace.py).

Groups the traced steps into decode-only steps by batch size (in bins of --bin sequences) and
steps with prefill tokens by token count, and prints per group: steps, median and mean device
busy time, and median and mean gap before the step (device idle waiting for the host; the first
step after an idle engine has no gap). Totals say what share of the traced device time was busy.
Steps with prefill are also split by their prefill tokens (tokens beyond the decodes): at most
--short-prefill (128, the limit of runner/decode_rows.py) or more, with the busy time's p90.
Traces that say how the runner ran each step (`graph`, since the field was added) are also
grouped by it: decode_graph, decode_rows, piecewise, eager.

With --split-s S the trace is first cut wherever no step launched for S seconds (a benchmark's
rates, one after another on one server) and each segment is summarised on its own.

  python benchmarks/serving/step_trace_summary.py trace.jsonl [--bin 8] [--split-s 5] [--short-prefill 128] [--out summary.json]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections import defaultdict
from pathlib import Path


def summarise(lines: list[dict], bin_seqs: int = 8, bin_tokens: int = 256, short_prefill: int = 128) -> dict:
    groups: dict[tuple[str, int], list[dict]] = defaultdict(list)
    for s in lines:
        if s["seqs"] == 0:
            continue
        if s["tokens"] == s["decodes"]:
            key = ("decode", (s["seqs"] - 1) // bin_seqs * bin_seqs + 1)
        else:
            key = ("mixed", (s["tokens"] - 1) // bin_tokens * bin_tokens + 1)
        groups[key].append(s)

    def stats(steps: list[dict]) -> dict:
        busy = [s["busy_ms"] for s in steps]
        gaps = [s["gap_ms"] for s in steps if s["gap_ms"] is not None]
        return {"steps": len(steps),
                "mean_seqs": round(statistics.fmean(s["seqs"] for s in steps), 1),
                "mean_tokens": round(statistics.fmean(s["tokens"] for s in steps), 1),
                "busy_ms_p50": round(statistics.median(busy), 4), "busy_ms_mean": round(statistics.fmean(busy), 4),
                "busy_ms_p90": round(sorted(busy)[int(0.9 * len(busy))], 4),
                "gap_ms_p50": round(statistics.median(gaps), 4) if gaps else None,
                "gap_ms_mean": round(statistics.fmean(gaps), 4) if gaps else None}

    out = {"decode": {}, "mixed": {}}
    for (kind, lo), steps in sorted(groups.items()):
        width = bin_seqs if kind == "decode" else bin_tokens
        out[kind][f"{lo}-{lo + width - 1}"] = stats(steps)
    prefill = [s for s in lines if s["tokens"] > s["decodes"]]
    for name, steps in ((f"prefill_1-{short_prefill}", [s for s in prefill if s["tokens"] - s["decodes"] <= short_prefill]),
                        (f"prefill_over_{short_prefill}", [s for s in prefill if s["tokens"] - s["decodes"] > short_prefill])):
        out[name] = stats(steps) if steps else None
    by_graph: dict[str, list[dict]] = defaultdict(list)
    for s in lines:
        if s["seqs"] and s.get("graph"):
            by_graph[s["graph"]].append(s)
    if by_graph:
        out["graph"] = {path: stats(steps) for path, steps in sorted(by_graph.items())}
    busy = sum(s["busy_ms"] for s in lines)
    gaps = sum(s["gap_ms"] for s in lines if s["gap_ms"] is not None)
    out["total"] = {"steps": len(lines), "busy_ms": round(busy, 1), "gap_ms": round(gaps, 1),
                    "busy_share": round(busy / (busy + gaps), 4) if busy + gaps else None,
                    "decode_only_steps": sum(1 for s in lines if s["seqs"] and s["tokens"] == s["decodes"])}
    return out


def segments(lines: list[dict], split_s: float) -> list[list[dict]]:
    """The lines cut wherever consecutive launches are more than split_s seconds apart."""
    out: list[list[dict]] = []
    for s in lines:
        if not out or s["t"] - out[-1][-1]["t"] > split_s:
            out.append([])
        out[-1].append(s)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("trace")
    ap.add_argument("--bin", type=int, default=8, help="decode steps: sequences per group")
    ap.add_argument("--bin-tokens", type=int, default=256, help="mixed steps: tokens per group")
    ap.add_argument("--short-prefill", type=int, default=128, help="prefill tokens of a short-prefill step")
    ap.add_argument("--split-s", type=float, default=None, help="summarise segments cut at idle gaps this long")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    lines = [json.loads(x) for x in Path(args.trace).read_text().splitlines() if x.strip()]
    if not lines:
        sys.exit(f"{args.trace}: no steps")
    if args.split_s is None:
        doc = {"trace": args.trace, **summarise(lines, args.bin, args.bin_tokens, args.short_prefill)}
    else:
        doc = {"trace": args.trace, "segments": [
            {"start_t": seg[0]["t"], "seconds": round(seg[-1]["t"] - seg[0]["t"], 1),
             **summarise(seg, args.bin, args.bin_tokens, args.short_prefill)} for seg in segments(lines, args.split_s)]}
    text = json.dumps(doc, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
