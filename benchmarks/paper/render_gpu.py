"""Render benchmarks/results/h200/*.json (from benchmarks/paper/paper_gpu.py) into PNGs and into the
marked sections of docs/paper-results.md. `python benchmarks/paper/paper_figures.py gpu` runs this.

A missing or unreadable results file leaves its section saying so; nothing is estimated.
Sections in the doc are delimited by `<!-- gpu:NAME -->` ... `<!-- /gpu:NAME -->`.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import matplotlib.pyplot as plt

from figure_plots import COLORS, LABELS, _save

SECTIONS = ["serving_load", "block_size", "swap_vs_recompute", "kv_breakdown", "memory_gpu", "shared_prefix"]
# The results file each section reads, and the h200_run.sh phase that writes it.
SOURCE = {"serving_load": ("serving_load", "paper"), "block_size": ("block_size", "paper2"),
          "swap_vs_recompute": ("swap_vs_recompute", "paper2"), "kv_breakdown": ("serving_load", "paper"),
          "shared_prefix": ("shared_prefix", "paper2"), "memory_gpu": ("memory_breakdown", "memory")}


def _load(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _header(doc: dict) -> list[str]:
    lines = [f"Measured on {doc.get('device')} at commit `{str(doc.get('commit'))[:10]}` on {doc.get('date')}:",
             "", f"    {doc.get('command')}", ""]
    if doc.get("note"):
        lines += [f"_Note: {doc['note']}_", ""]
    return lines


def serving_load(doc: dict, fig_dir: Path, _results: Path) -> list[str]:
    res, cfg = doc["results"], doc["config"]
    curves, sustained, bound = res["curves"], res.get("sustained_rate", {}), res.get("sustained_rate_bound", {})
    thr = cfg.get("latency_threshold_s_per_token")
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(12, 4.4))
    for a, pts in curves.items():
        kw = {"color": COLORS.get(a), "label": LABELS.get(a, a).replace("\n", " ")}
        ax.plot([p["rate"] for p in pts], [p["normalized_latency_s_per_token"] for p in pts], "o-", **kw)
        bx.plot([p["rate"] for p in pts], [p["avg_batched_requests"] for p in pts], "o-", **kw)
    if thr:
        ax.axhline(thr, color="grey", ls=":", label=f"threshold {thr:.4f} s/token")
    ax.set_yscale("log")
    ax.set_ylabel("normalized latency (s/token)")
    ax.set_title(f"Fig. 12: {cfg.get('model')} on {doc.get('device')}, sharegpt-like")
    bx.set_ylabel("average batched requests per step")
    bx.set_title("Fig. 13: batched requests")
    for a_ in (ax, bx):
        a_.set_xlabel("request rate (req/s, Poisson)")
        a_.legend(fontsize=8)
    _save(fig, fig_dir / "h200_serving_load.png")
    rates = sorted({p["rate"] for pts in curves.values() for p in pts})
    cell = {a: {p["rate"]: p for p in pts} for a, pts in curves.items()}
    lines = _header(doc) + ["![GPU serving load](figures/h200_serving_load.png)", "",
                            "Normalized latency in s/token (average batched requests) per request rate; a dash "
                            "where an allocator had already crossed the threshold at a lower rate:", "",
                            "| allocator | " + " | ".join(f"{r:g} req/s" for r in rates) + " |",
                            "|---" * (len(rates) + 1) + "|"]
    for a in curves:
        row = [f"{cell[a][r]['normalized_latency_s_per_token']:.4f} ({cell[a][r]['avg_batched_requests']:.1f})"
               if r in cell[a] else "-" for r in rates]
        lines.append(f"| {a} | " + " | ".join(row) + " |")
    lines += ["", f"Sustained rate at the threshold ({thr:.4f} s/token, 2x paged's at {rates[0]:g} req/s):", "",
              "| allocator | sustained rate (req/s) | paged's advantage |", "|---|---|---|"]
    note = {"lower": " (never crossed: at least this)", "upper": " (crossed at the lowest rate: at most this)"}
    for a, v in sustained.items():
        if v is None:
            lines.append(f"| {a} | below the lowest rate | |")
            continue
        adv = "—" if a == "paged" or not sustained.get("paged") else f"{sustained['paged'] / v:.2f}x"
        lines.append(f"| {a} | {v:.2f}{note.get(bound.get(a), '')} | {adv} |")
    lines += ["", "Ratios: " + ", ".join(f"{k} = {v}" for k, v in doc.get("ratios", {}).items())]
    return lines


def block_size(doc: dict, fig_dir: Path, results: Path) -> list[str]:
    """End-to-end throughput per block size, beside the decode kernel's latency per block size
    (bench_paged_decode.py's block-size sweep in paged_decode.json, when present)."""
    rows = {k: v for k, v in doc["results"]["by_block_size"].items() if "output_tokens_per_s" in v}
    sizes = sorted(rows, key=int)
    kernel_doc = _load(results / "h200" / "paged_decode.json") or {}
    kernel = {str(r["block_size"]): r for r in kernel_doc.get("results", {}).get("block_size_sweep", []) if "ms" in r}
    fig, ax = plt.subplots(figsize=(6.4, 4))
    ax.bar(range(len(sizes)), [rows[s]["output_tokens_per_s"] for s in sizes], color="#1565c0")
    ax.set_xticks(range(len(sizes)), sizes)
    ax.set_xlabel("block size (tokens)")
    ax.set_ylabel("output tokens/s")
    ax.set_title(f"{doc['config'].get('model')} on {doc.get('device')}, sharegpt-like")
    if kernel:
        kx = ax.twinx()
        kx.plot(range(len(sizes)), [kernel[s]["ms"] if s in kernel else float("nan") for s in sizes], "ko-",
                label="decode kernel ms (right)")
        kx.set_ylabel("decode kernel ms, 64 x 4096 context")
        kx.set_ylim(0, 1.5 * max(r["ms"] for r in kernel.values()))
        kx.legend(loc="lower right", fontsize=8)
    _save(fig, fig_dir / "h200_block_size.png")
    lines = _header(doc) + ["![GPU block size](figures/h200_block_size.png)", "",
                            "| block size | output tok/s | normalized latency (s/token) | peak blocks | decode kernel ms "
                            "(fraction of copy bandwidth) |", "|---|---|---|---|---|"]
    for s in sizes:
        k = kernel.get(s)
        kcell = f"{k['ms']:.3f} ({k.get('bandwidth_fraction', float('nan')):.3f})" if k else "-"
        lines.append(f"| {s} | {rows[s].get('output_tokens_per_s')} | {rows[s].get('normalized_latency_s_per_token')} "
                     f"| {rows[s].get('peak_blocks_used')} | {kcell} |")
    if kernel:
        c = kernel_doc.get("config", {})
        lines += ["", f"Decode kernel column: `{kernel_doc.get('command')}` at commit "
                      f"`{str(kernel_doc.get('commit'))[:10]}` (batch {c.get('batch')} x context {c.get('context')}, "
                      f"{c.get('num_heads')} q / {c.get('num_kv_heads')} KV heads, head_dim {c.get('head_dim')})."]
    return lines


def swap_vs_recompute(doc: dict, fig_dir: Path, _results: Path) -> list[str]:
    rows = {k: v for k, v in doc["results"]["by_block_size"].items() if "recompute_s" in v}
    sizes = sorted(rows, key=int)
    fig, ax = plt.subplots(figsize=(6.4, 4))
    ax.plot(range(len(sizes)), [1e3 * rows[s]["swap_out_in_s"] for s in sizes], "o-", label="swap out + in")
    ax.plot(range(len(sizes)), [1e3 * rows[s]["recompute_s"] for s in sizes], "s--", label="recompute")
    ax.set_xticks(range(len(sizes)), sizes)
    ax.set_xlabel("block size (tokens)")
    ax.set_ylabel(f"ms for {rows[sizes[0]].get('tokens')} tokens")
    ax.set_title(f"{doc['config'].get('model')} on {doc.get('device')}")
    ax.legend()
    _save(fig, fig_dir / "h200_swap_vs_recompute.png")
    lines = _header(doc) + ["![GPU swap vs recompute](figures/h200_swap_vs_recompute.png)", "",
                            "| block size | blocks moved | swap out + in (ms) | recompute (ms) | swap / recompute |",
                            "|---|---|---|---|---|"]
    lines += [f"| {s} | {rows[s]['blocks']} | {1e3 * rows[s]['swap_out_in_s']:.2f} | {1e3 * rows[s]['recompute_s']:.2f} "
              f"| {rows[s]['swap_out_in_s'] / rows[s]['recompute_s']:.2f} |" for s in sizes]
    return lines


def kv_breakdown(doc: dict, fig_dir: Path, _results: Path) -> list[str]:
    """Figure 2 measured on the GPU engine during the serving-load sweep (serving_load.json)."""
    split = doc["results"]["memory_breakdown_gpu_engine"]
    keys = ("token_states", "reserved", "internal_fragmentation", "external_fragmentation")
    lines = [f"Measured on {doc.get('device')} at commit `{str(doc.get('commit'))[:10]}` on {doc.get('date')}, "
             "averaged over every engine step of the serving-load sweep above (same requests, same engine):", "",
             "| allocator | " + " | ".join(keys) + " |", "|---" * (len(keys) + 1) + "|"]
    lines += [f"| {a} | " + " | ".join(f"{100 * fr.get(k, 0):.1f}%" for k in keys) + " |" for a, fr in split.items()]
    return lines


def memory_gpu(doc: dict, fig_dir: Path, results: Path) -> list[str]:
    """Figure 2 on the GPU engine with the sim's requests and settings (memory_breakdown.json), beside
    the sim over the same steps and the sim's whole run (results/sim/memory_breakdown.json)."""
    cfg, res = doc["config"], doc["results"]
    full = (_load(results / "sim" / "memory_breakdown.json") or {}).get("results", {})
    keys = ("token_states", "reserved", "internal_fragmentation", "external_fragmentation")
    pct = lambda fr: " / ".join(f"{100 * fr[k]:.1f}" for k in keys)  # noqa: E731
    lines = _header(doc) + [
        f"{cfg['num_requests']} requests of each workload queued at t=0, {cfg['num_gpu_blocks']} blocks of "
        f"{cfg['block_size']}, preemption by recompute, prefix caching off, {cfg['model']} shape; the first "
        f"{cfg['steps']} engine steps. Shares in % (token states / reserved / internal / external):", "",
        "| workload | allocator | GPU engine | sim, same steps | largest difference at any step | sim, whole run |",
        "|---|---|---|---|---|---|"]
    for w, by in res.items():
        for a, r in by.items():
            whole = full.get(w, {}).get(a, {}).get("breakdown")
            lines.append(f"| {w} | {a} | {pct(r['breakdown_gpu_engine'])} | {pct(r['breakdown_sim'])} | "
                         f"{r['max_abs_step_difference']} | {pct(whole) if whole else '-'} |")
    return lines


def shared_prefix(doc: dict, fig_dir: Path, _results: Path) -> list[str]:
    """The seed's scenario (issue 6): the same users with prefix caching off, then on."""
    cfg, res = doc["config"], doc["results"]
    keys = [("peak_blocks_used", "peak KV blocks"), ("mean_ttft_s", "mean TTFT (s)"),
            ("ttft_first_user_s", "first user's TTFT (s)"), ("mean_ttft_later_half_s", "later half's mean TTFT (s)"),
            ("p90_ttft_s", "p90 TTFT (s)"), ("mean_e2e_s", "mean end-to-end (s)"),
            ("output_tokens_per_s", "output tok/s"), ("prefix_cache_hits", "prefix-cache hit tokens"),
            ("prefix_cache_queries", "prefix-cache query tokens")]
    lines = _header(doc) + [f"{cfg.get('users')} users of {cfg.get('model')}, one {cfg.get('prefix_len')}-token system "
                            f"prompt plus 20-200 tokens of their own, 128 output tokens each, Poisson arrivals at "
                            f"{cfg.get('request_rate')} req/s:", "",
                            "| | caching off | caching on |", "|---|---|---|"]
    lines += [f"| {label} | {res['uncached'].get(k)} | {res['cached'].get(k)} |" for k, label in keys]
    lines += ["", "Ratios: " + ", ".join(f"{k} = {v}" for k, v in doc.get("ratios", {}).items())]
    return lines


RENDER = {"serving_load": serving_load, "block_size": block_size, "swap_vs_recompute": swap_vs_recompute,
          "kv_breakdown": kv_breakdown, "memory_gpu": memory_gpu, "shared_prefix": shared_prefix}



def render(results_dir: Path, fig_dir: Path) -> dict[str, str]:
    out = {}
    for name in SECTIONS:
        fname, phase = SOURCE[name]
        doc = _load(results_dir / "h200" / f"{fname}.json")
        if doc is None:
            out[name] = (f"_Not measured yet: `benchmarks/results/h200/{fname}.json` is absent. Run "
                         f"`bash benchmarks/h200_run.sh {phase}` on the H200, then "
                         f"`python benchmarks/paper/paper_figures.py gpu`._")
            continue
        try:
            out[name] = "\n".join(RENDER[name](doc, fig_dir, results_dir))
        except (KeyError, TypeError, ValueError) as e:
            out[name] = f"_`{name}.json` is present but could not be rendered ({type(e).__name__}: {e})._"
    return out


def run(args) -> None:
    sections = render(args.results_dir, args.fig_dir)
    doc_path: Path = args.doc
    if not doc_path.exists():
        print("\n\n".join(f"### {k}\n{v}" for k, v in sections.items()))
        return
    text = doc_path.read_text()
    for name, body in sections.items():
        pat = re.compile(rf"(<!-- gpu:{name} -->\n).*?(<!-- /gpu:{name} -->)", re.S)
        text = pat.sub(lambda m: m.group(1) + body + "\n" + m.group(2), text)
    doc_path.write_text(text)
    print(f"wrote {doc_path}")
