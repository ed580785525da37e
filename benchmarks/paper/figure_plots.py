"""matplotlib drawings of the paper figures; data in, one PNG out (the caller sets the Agg backend)."""
from __future__ import annotations

from pathlib import Path

import matplotlib.pyplot as plt
from matplotlib.collections import PatchCollection
from matplotlib.patches import Patch, Rectangle

SEGMENTS = [("token_states", "token states", "#2e7d32"), ("reserved", "reserved", "#f9a825"),
            ("internal_fragmentation", "internal fragmentation", "#e53935"),
            ("external_fragmentation", "external fragmentation", "#8e24aa")]
LABELS = {"paged": "paged (block 16)", "contiguous-oracle": "contiguous-oracle\n(Orca Oracle)",
          "contiguous-pow2": "contiguous-pow2\n(Orca Pow2)", "contiguous-max": "contiguous-max\n(Orca Max)"}
COLORS = {"paged": "#1565c0", "contiguous-oracle": "#2e7d32", "contiguous-pow2": "#f9a825",
          "contiguous-max": "#e53935"}


def _save(fig, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=130, bbox_inches="tight")
    plt.close(fig)
    print(f"wrote {path}")


def memory_breakdown(results: dict, path: Path, paper: dict | None = None) -> None:
    """Figure 2: one stacked bar per allocator, per workload; paper: {workload: {allocator: %}} markers."""
    paper = paper or {}
    fig, axes = plt.subplots(1, len(results), figsize=(6.2 * len(results), 4.6), sharey=True)
    for ax, (workload, by_alloc) in zip(axes, results.items()):
        names = list(by_alloc)
        bottom = [0.0] * len(names)
        for key, label, color in SEGMENTS:
            vals = [100 * by_alloc[a]["breakdown"][key] for a in names]
            ax.bar(range(len(names)), vals, bottom=bottom, color=color, label=label, width=0.65)
            for i, v in enumerate(vals):
                if v >= 2.5:
                    ax.text(i, bottom[i] + v / 2, f"{v:.1f}%", ha="center", va="center", fontsize=7.5,
                            color="black" if key == "reserved" else "white")
            bottom = [b + v for b, v in zip(bottom, vals)]
        if workload in paper:
            xs = [i for i, a in enumerate(names) if a in paper[workload]]
            ax.scatter(xs, [paper[workload][names[i]] for i in xs], marker="D", s=28, color="black", zorder=3,
                       label="paper Fig. 2 token states (ShareGPT, OPT-13B)")
        ax.set_xticks(range(len(names)), [LABELS.get(a, a) for a in names], fontsize=8)
        ax.set_title(f"{workload}: KV memory, time-averaged")
        ax.set_ylim(0, 100)
    axes[0].set_ylabel("share of KV cache memory (%)")
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="upper center", bbox_to_anchor=(0.5, 0.0), ncol=5, fontsize=8, frameon=False)
    _save(fig, path)


def _cells(ax, num_blocks: int, cols: int, fills) -> None:
    """Draw num_blocks cells row-major; fills(block) -> [(fraction, facecolor)] left to right."""
    rects, colors = [], []
    for b in range(num_blocks):
        x, y = b % cols, -(b // cols)
        rects.append(Rectangle((x, y), 0.92, 0.92))
        colors.append("#ffffff")
        left = 0.0
        for frac, color in fills(b):
            if frac > 0:
                rects.append(Rectangle((x + left * 0.92, y), frac * 0.92, 0.92))
                colors.append(color)
                left += frac
    ax.add_collection(PatchCollection(rects, facecolors=colors, edgecolors="none"))
    for b in range(num_blocks):
        ax.add_patch(Rectangle((b % cols, -(b // cols)), 0.92, 0.92, fill=False, lw=0.2, ec="#bbbbbb"))
    rows = -(-num_blocks // cols)
    ax.set_xlim(-0.5, cols + 0.5)
    ax.set_ylim(-rows + 0.5, 1.5)
    ax.set_aspect("equal")
    ax.axis("off")


def paging_picture(snap: dict, path: Path, cols: int = 36) -> None:
    """Left: contiguous-max reserved runs in physical memory; right: the same requests in pages."""
    cmap = plt.get_cmap("tab10")
    bs, nb = snap["block_size"], snap["num_blocks"]
    reqs = sorted(snap["requests"], key=lambda r: r["start_block"])
    color = {r["request_id"]: cmap(i % 10) for i, r in enumerate(reqs)}
    owner: dict[int, tuple[dict, int]] = {}
    for r in reqs:
        for j in range(r["num_blocks"]):
            owner[r["start_block"] + j] = (r, j)
    need = snap.get("head_need_blocks") or 0
    ext = {s + i for s, n in snap["holes"] if n < need for i in range(n)}

    def slab(b):
        if b in ext:
            return [(1.0, "#37474f")]
        if b not in owner:
            return []
        r, j = owner[b]
        lo = j * bs
        live = min(max(r["computed"] - lo, 0), bs)
        will = min(max(r["final_len"] - lo, 0), bs)
        c = color[r["request_id"]]
        return [(live / bs, c), ((will - live) / bs, (*c[:3], 0.3)), ((bs - will) / bs, "#d9d9d9")]

    paged_owner = {b: (rid, j) for rid, t in snap["paged_tables"].items() for j, b in enumerate(t)}
    by_id = {r["request_id"]: r for r in reqs}

    def page(b):
        if b not in paged_owner:
            return []
        rid, j = paged_owner[b]
        live = min(max(by_id[rid]["computed"] - j * bs, 0), bs)
        return [(live / bs, color[rid]), ((bs - live) / bs, "#d9d9d9")]

    live = sum(r["computed"] for r in reqs)
    reserved = sum(r["num_blocks"] for r in reqs) * bs
    used = sum(len(t) for t in snap["paged_tables"].values())
    fig, axes = plt.subplots(1, 2, figsize=(13, 6.2))
    _cells(axes[0], nb, cols, slab)
    free_c = nb - sum(r["num_blocks"] for r in reqs)
    usable = "none" if len(ext) == free_c else ("all" if not ext else f"{free_c - len(ext)}")
    waiting = f", {usable} usable by the next request" if need else ""
    axes[0].set_title(f"contiguous-max (Orca Max): {len(reqs)} requests reserve {reserved:,} slots\n"
                      f"for {live:,} live tokens ({live / reserved:.0%}); {free_c} free blocks{waiting}",
                      fontsize=9)
    _cells(axes[1], nb, cols, page)
    free = nb - used
    axes[1].set_title(f"paged (block {bs}): the same {len(reqs)} requests in {used} blocks "
                      f"({live / (used * bs):.0%} filled)\n{free} blocks ({free / nb:.0%}) free for more requests",
                      fontsize=9)
    handles = [Patch(color="#555555", label="live token states (one color per request)"),
               Patch(color="#555555", alpha=0.3, label="reserved: this request will fill it"),
               Patch(color="#d9d9d9", label="never used (internal fragmentation)"),
               Patch(color="#37474f", label="free hole too small for the next request (external fragmentation)"),
               Patch(facecolor="white", edgecolor="#bbbbbb", label="free block")]
    fig.legend(handles=handles, loc="lower center", ncol=3, fontsize=8, frameon=False)
    fig.suptitle(f"The same KV memory ({nb} blocks x {bs} slots), sharegpt-like, sim step {snap['step']}; "
                 "one cell = one block", fontsize=10)
    _save(fig, path)


def block_size(results: dict, rates: dict, path: Path) -> None:
    """Figure 18b: normalized latency and memory use per block size, one column per workload."""
    fig, axes = plt.subplots(2, len(results), figsize=(5.6 * len(results), 6.4), sharex=True)
    for col, (workload, by_bs) in enumerate(results.items()):
        sizes = sorted(by_bs, key=int)
        x = range(len(sizes))
        lat = [by_bs[s]["normalized_latency_s_per_token"] for s in sizes]
        axes[0][col].bar(x, lat, color="#1565c0")
        axes[0][col].set_title(f"{workload} at {rates[workload]:g} req/s (Poisson)")
        axes[0][col].set_ylabel("normalized latency (s/token)")
        axes[1][col].plot(x, [100 * by_bs[s]["breakdown"]["token_states"] for s in sizes], "o-",
                          label="token states share (Fig. 2 metric)")
        axes[1][col].plot(x, [100 * by_bs[s]["kv_utilization"] for s in sizes], "s--",
                          label="kv_utilization (live / allocated)")
        axes[1][col].set_ylabel("% of allocated KV memory")
        axes[1][col].set_xticks(list(x), sizes)
        axes[1][col].set_xlabel("block size (tokens)")
        axes[1][col].legend(fontsize=8)
    _save(fig, path)


def serving_load(curves: dict, threshold: float, sustained: dict, path: Path) -> None:
    """Figures 12/13: normalized latency vs request rate per allocator, threshold and sustained rates."""
    fig, ax = plt.subplots(figsize=(7, 4.6))
    for a, pts in curves.items():
        label = LABELS.get(a, a).replace("\n", " ")
        if sustained.get(a):
            label += f": sustains {sustained[a]:.2f} req/s"
        ax.plot([p["rate"] for p in pts], [p["normalized_latency_s_per_token"] for p in pts], "o-",
                color=COLORS.get(a), label=label)
    ax.axhline(threshold, color="grey", ls=":", label=f"threshold {threshold:.3f} s/token (2x paged at low load)")
    ax.set_yscale("log")
    ax.set_xlabel("request rate (req/s, Poisson)")
    ax.set_ylabel("normalized latency (s/token)")
    ax.set_title("sharegpt-like, sim (OPT-13B / A100 step-time model, 15.7K KV slots)")
    ax.legend(fontsize=8)
    _save(fig, path)


def sharing(results: dict, paper: dict, path: Path) -> None:
    """Figure 15: memory saved by sharing, per width, with the paper's range shaded."""
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, (kind, by_k) in zip(axes, results.items()):
        ks = sorted(by_k, key=int)
        ax.bar(range(len(ks)), [100 * by_k[k]["saving_mean_over_steps"] for k in ks], color="#1565c0",
               label="pagedserve (CPU engine, tiny OPT)")
        lo, hi = paper[kind]
        ax.axhspan(100 * lo, 100 * hi, color="#f9a825", alpha=0.3, label="paper Fig. 15 range (OPT-13B)")
        for i, k in enumerate(ks):
            v = 100 * by_k[k]["saving_mean_over_steps"]
            ax.text(i, v / 2, f"{v:.1f}%", ha="center", va="center", fontsize=9, color="white")
        ax.set_ylim(0, 1.35 * max(100 * hi, max(100 * by_k[k]["saving_mean_over_steps"] for k in ks)))
        label = "# output sequences" if kind == "parallel_sampling" else "beam width"
        ax.set_xticks(range(len(ks)), ks)
        ax.set_xlabel(label)
        ax.set_ylabel("memory saving (%)")
        ax.set_title(kind.replace("_", " ") + ", alpaca-like lengths")
        ax.legend(fontsize=8, loc="upper left")
    _save(fig, path)
