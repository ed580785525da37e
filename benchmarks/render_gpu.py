"""Render benchmarks/results/h200/*.json (from benchmarks/paper_gpu.py) into PNGs and into the
marked sections of docs/paper-results.md. `python benchmarks/paper_figures.py gpu` runs this.

A missing or unreadable results file leaves its section saying so; nothing is estimated.
Sections in the doc are delimited by `<!-- gpu:NAME -->` ... `<!-- /gpu:NAME -->`.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import matplotlib.pyplot as plt

from figure_plots import COLORS, LABELS, _save

SECTIONS = ["serving_load", "block_size", "swap_vs_recompute", "kv_breakdown"]
# The results file each section reads, and the h200_run.sh phase that writes it.
SOURCE = {"serving_load": ("serving_load", "paper"), "block_size": ("block_size", "paper2"),
          "swap_vs_recompute": ("swap_vs_recompute", "paper2"), "kv_breakdown": ("serving_load", "paper")}


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


def serving_load(doc: dict, fig_dir: Path) -> list[str]:
    res, cfg = doc["results"], doc["config"]
    curves, sustained = res["curves"], res.get("sustained_rate", {})
    thr = cfg.get("latency_threshold_s_per_token")
    fig, ax = plt.subplots(figsize=(7, 4.6))
    for a, pts in curves.items():
        ax.plot([p["rate"] for p in pts], [p["normalized_latency_s_per_token"] for p in pts], "o-",
                color=COLORS.get(a), label=LABELS.get(a, a).replace("\n", " "))
    if thr:
        ax.axhline(thr, color="grey", ls=":", label=f"threshold {thr:.3f} s/token")
    ax.set_yscale("log")
    ax.set_xlabel("request rate (req/s, Poisson)")
    ax.set_ylabel("normalized latency (s/token)")
    ax.set_title(f"{cfg.get('model')} on {doc.get('device')}, sharegpt-like")
    ax.legend(fontsize=8)
    _save(fig, fig_dir / "h200_serving_load.png")
    lines = _header(doc) + ["![GPU serving load](figures/h200_serving_load.png)", "",
                            "| allocator | sustained rate (req/s) |", "|---|---|"]
    lines += [f"| {a} | {v:.2f} |" if v is not None else f"| {a} | below the lowest rate |"
              for a, v in sustained.items()]
    lines += ["", "Ratios: " + ", ".join(f"{k} = {v}" for k, v in doc.get("ratios", {}).items())]
    return lines


def block_size(doc: dict, fig_dir: Path) -> list[str]:
    rows = {k: v for k, v in doc["results"]["by_block_size"].items() if "output_tokens_per_s" in v}
    sizes = sorted(rows, key=int)
    fig, ax = plt.subplots(figsize=(6.4, 4))
    ax.bar(range(len(sizes)), [rows[s]["output_tokens_per_s"] for s in sizes], color="#1565c0")
    ax.set_xticks(range(len(sizes)), sizes)
    ax.set_xlabel("block size (tokens)")
    ax.set_ylabel("output tokens/s")
    ax.set_title(f"{doc['config'].get('model')} on {doc.get('device')}, sharegpt-like")
    _save(fig, fig_dir / "h200_block_size.png")
    lines = _header(doc) + ["![GPU block size](figures/h200_block_size.png)", "",
                            "| block size | output tok/s | normalized latency (s/token) |", "|---|---|---|"]
    lines += [f"| {s} | {rows[s].get('output_tokens_per_s')} | {rows[s].get('normalized_latency_s_per_token')} |"
              for s in sizes]
    return lines


def swap_vs_recompute(doc: dict, fig_dir: Path) -> list[str]:
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
                            "| block size | swap out + in (ms) | recompute (ms) |", "|---|---|---|"]
    lines += [f"| {s} | {1e3 * rows[s]['swap_out_in_s']:.2f} | {1e3 * rows[s]['recompute_s']:.2f} |" for s in sizes]
    return lines


def kv_breakdown(doc: dict, fig_dir: Path) -> list[str]:
    """Figure 2 measured on the GPU engine during the serving-load sweep (serving_load.json)."""
    split = doc["results"]["memory_breakdown_gpu_engine"]
    keys = ("token_states", "reserved", "internal_fragmentation", "external_fragmentation")
    lines = [f"Measured on {doc.get('device')} at commit `{str(doc.get('commit'))[:10]}` on {doc.get('date')}, "
             "averaged over every engine step of the serving-load sweep above (same requests, same engine):", "",
             "| allocator | " + " | ".join(keys) + " |", "|---" * (len(keys) + 1) + "|"]
    lines += [f"| {a} | " + " | ".join(f"{100 * fr.get(k, 0):.1f}%" for k in keys) + " |" for a, fr in split.items()]
    return lines


RENDER = {"serving_load": serving_load, "block_size": block_size, "swap_vs_recompute": swap_vs_recompute,
          "kv_breakdown": kv_breakdown}


def render(results_dir: Path, fig_dir: Path) -> dict[str, str]:
    out = {}
    for name in SECTIONS:
        fname, phase = SOURCE[name]
        doc = _load(results_dir / "h200" / f"{fname}.json")
        if doc is None:
            out[name] = (f"_Not measured yet: `benchmarks/results/h200/{fname}.json` is absent. Run "
                         f"`bash benchmarks/h200_run.sh {phase}` on the H200, then "
                         f"`python benchmarks/paper_figures.py gpu`._")
            continue
        try:
            out[name] = "\n".join(RENDER[name](doc, fig_dir))
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
