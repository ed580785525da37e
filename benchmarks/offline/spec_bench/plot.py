"""Issue #36's picture: TPOT and throughput against acceptance rate and k, at every batch, from
spec_decode.json (collect's output). `spec_decode_bench.py plot` draws it; nothing is re-measured.

Each point is one run of our part: x is the acceptance the engine's counters measured (not the
a that was asked for), TPOT is drawn over the same batch's TPOT with speculation off (below 1:
faster). Replay = a free draft (what verification alone costs and gains), draft = the draft model
equal to the target (each proposal costs a target-sized forward). vLLM's draft = target runs at
k = 4, where the file has them on our checkpoint, are crosses, over our off TPOT too.
"""
from __future__ import annotations

import re
from pathlib import Path

KINDS = ("replay", "draft")


def series(doc: dict) -> dict:
    """{batch: {"off": (tpot, tok/s), "accept": {kind: [(acc, tpot, tok/s)] at k = 4, by acceptance},
    "k": {kind: [(k, tpot, tok/s)] at a = 1, k = 0 is off}, "vllm": [(acc, tpot, tok/s)]}}."""
    out = {}
    for b, runs in doc["results"]["ours"].items():
        off = runs.get("off") if re.fullmatch(r"b\d+", b) else None  # beside the batches: engine_seconds
        if not off:
            continue
        row = {"off": (off["tpot_ms"], off["output_tokens_per_s"]), "accept": {}, "k": {}, "vllm": []}
        for kind in KINDS:
            pts = [(r["acceptance_rate"], r["tpot_ms"], r["output_tokens_per_s"]) for name, r in runs.items()
                   if name.startswith(f"k4_{kind}_a") and r.get("acceptance_rate") is not None]
            row["accept"][kind] = sorted(pts)
            ks = [(0, *row["off"])] + [(k, runs[f"k{k}_{kind}_a1"]["tpot_ms"], runs[f"k{k}_{kind}_a1"]["output_tokens_per_s"])
                                       for k in (1, 2, 4) if f"k{k}_{kind}_a1" in runs]
            row["k"][kind] = ks
        theirs = doc["results"].get("vllm", {}).get("draft_model_k4", {}).get(b)
        compared = doc.get("config", {}).get("vllm_compared")
        if theirs and theirs.get("tpot_ms") and (compared is None or "draft_model_k4" in compared):
            row["vllm"].append((theirs.get("acceptance_rate"), theirs["tpot_ms"], theirs.get("output_tokens_per_s")))
        out[int(b.lstrip("b"))] = row
    return dict(sorted(out.items()))


def plot(doc: dict, path: Path) -> dict:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    data = series(doc)
    colors = dict(zip(data, ["#1565c0", "#2e7d32", "#f9a825", "#e53935", "#8e24aa"]))
    style = {"replay": "o-", "draft": "s--"}
    fig, axes = plt.subplots(2, 2, figsize=(12, 9), constrained_layout=True)
    (ta, ra), (tk, rk) = axes
    for b, row in data.items():
        off_tpot, _ = row["off"]
        c = colors[b]
        for kind in KINDS:
            acc = row["accept"][kind]
            ta.plot([p[0] for p in acc], [p[1] / off_tpot for p in acc], style[kind], color=c,
                    label=f"batch {b}, {kind}")
            ra.plot([p[0] for p in acc], [p[2] for p in acc], style[kind], color=c)
            ks = row["k"][kind]
            tk.plot([p[0] for p in ks], [p[1] / off_tpot for p in ks], style[kind], color=c)
            rk.plot([p[0] for p in ks], [p[2] for p in ks], style[kind], color=c)
        for acc, tpot, tps in row["vllm"]:
            if acc is not None:
                ta.plot([acc], [tpot / off_tpot], "x", color=c, ms=9, mew=2)
                if tps:
                    ra.plot([acc], [tps], "x", color=c, ms=9, mew=2)
    for ax in (ta, tk):
        ax.axhline(1.0, color="grey", ls=":")
        ax.set_yscale("log")
        ax.set_ylabel("TPOT / TPOT with speculation off")
    for ax in (ra, rk):
        ax.set_yscale("log")
        ax.set_ylabel("output tokens/s")
    for ax in (ta, ra):
        ax.set_xlabel("measured acceptance rate (k = 4)")
    for ax in (tk, rk):
        ax.set_xlabel("k (0 = off), asked acceptance 1")
        ax.set_xticks([0, 1, 2, 4])
    ta.plot([], [], "x", color="black", label="vLLM 0.26 draft = target, k = 4")
    fig.legend(*ta.get_legend_handles_labels(), loc="outside lower center", ncol=5, fontsize=8)
    ta.set_title("TPOT against acceptance (o replay: a free draft; s draft = target)")
    ra.set_title("throughput against acceptance")
    tk.set_title("TPOT against k")
    rk.set_title("throughput against k")
    fig.suptitle(f"Speculative decoding, Llama-3.1-8B config, bf16, greedy, {doc.get('device')}, "
                 f"ours at {str(doc.get('commit'))[:7]} ({doc.get('date')})", fontsize=10)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return data
