"""The paper's memory figures from `pagedserve sim` (deterministic, no weights) and the CPU engine.

Each subcommand writes a JSON (docs/benchmarks.md's format, with the exact command) and a PNG:
  memory      Figure 2: KV memory split into token states / reserved / internal / external
              fragmentation, paged (block 16) vs contiguous-max / -pow2 / -oracle, both workloads
  picture     the seeds' opening picture from a real sim snapshot: contiguous slabs vs pages
  block-size  Figure 18b: token-state share, kv_utilization and normalized latency per block size
  load        Figures 12/13: normalized latency vs Poisson request rate, and the rate each
              allocator sustains at equal normalized latency
  sharing     Figure 15: KV blocks saved by sharing (parallel sampling, beam search), real CPU engine
  gpu         render benchmarks/results/h200/*.json (benchmarks/paper/paper_gpu.py) into PNGs and the doc
  all         memory, picture, block-size, load, sharing, gpu

--num-requests N runs the first N requests of each workload (CI's smoke test uses a few).
"""
from __future__ import annotations

import argparse
import shlex
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import matplotlib  # noqa: E402

matplotlib.use("Agg")
import figure_plots as plots  # noqa: E402

from pagedserve.benchmark.results import write_result  # noqa: E402
from pagedserve.benchmark.sustained import crossing_rate  # noqa: E402
from pagedserve.core.block_pool import BlockPool  # noqa: E402
from pagedserve.core.kv_cache_manager import cdiv  # noqa: E402
from pagedserve.sim import SIM_DEVICE, simulate  # noqa: E402

ALLOCATORS = ["paged", "contiguous-oracle", "contiguous-pow2", "contiguous-max"]
WORKLOADS = ["sharegpt-like", "alpaca-like"]
# Paper Figure 2, token states share (%), measured during its ShareGPT serving run.
PAPER_FIG2 = {"sharegpt-like": {"paged": 96.3, "contiguous-oracle": 38.2, "contiguous-pow2": 26.8,
                                "contiguous-max": 20.4}}
KEEP = ("num_requests", "num_finished", "steps", "sim_time_s", "avg_running", "preemptions", "peak_blocks_used",
        "kv_utilization", "breakdown", "normalized_latency_s_per_token", "throughput_output_tokens_per_s",
        "throughput_requests_per_s", "kv_budget_tokens", "num_blocks")


def write_json(path: Path, name: str, device: str, config: dict, results: dict, ratios: dict) -> dict:
    doc = write_result(path, name, "python benchmarks/paper/paper_figures.py " + shlex.join(sys.argv[1:]), config,
                       results, {}, ratios, device=device)
    print(f"wrote {path}")
    return doc


def _sim(kw: dict) -> dict:
    r = simulate(**kw)
    return {k: r[k] for k in KEEP}


def run_sims(args, kws: list[dict]) -> list[dict]:
    """Independent sim runs, in parallel processes when --jobs > 1; results in input order."""
    for kw in kws:
        kw.setdefault("num_requests", args.num_requests)
    if args.jobs <= 1:
        return [_sim(kw) for kw in kws]
    with ProcessPoolExecutor(args.jobs) as ex:
        return list(ex.map(_sim, kws))


# ---- Figure 2 ------------------------------------------------------------------------------
def cmd_memory(args) -> None:
    grid = [(w, a) for w in WORKLOADS for a in ALLOCATORS]
    runs = run_sims(args, [dict(workload=w, allocator=a, block_size=16) for w, a in grid])
    results: dict = {w: {} for w in WORKLOADS}
    for (w, a), r in zip(grid, runs):
        results[w][a] = r
    ratios = {f"{w}.{a}.token_states": round(results[w][a]["breakdown"]["token_states"], 4) for w, a in grid}
    write_json(args.results_dir / "sim" / "memory_breakdown.json", "memory_breakdown", SIM_DEVICE,
               {"workloads": WORKLOADS, "allocators": ALLOCATORS, "block_size": 16, "arrivals": "all at t=0",
                "num_requests": args.num_requests}, results, ratios)
    plots.memory_breakdown(results, args.fig_dir / "memory_breakdown.png", PAPER_FIG2)


# ---- the opening picture ------------------------------------------------------------------
def snapshot_contiguous(args, step: int) -> dict | None:
    """The running requests of a contiguous-max sim run and their reserved runs, at the first step
    >= `step` where the cache is saturated (the request at the head of the queue fits in no hole),
    the state the cache is in for most of a loaded run."""
    snap: dict = {}

    def on_step(s, scheduler):
        if snap or s < step or not scheduler.running or not scheduler.waiting:
            return
        mgr = scheduler.kv_cache_manager
        head = scheduler.waiting[0]
        need = cdiv(mgr.reservation_tokens(head, head.seqs[0]), mgr.block_size)
        if any(n >= need for _, n in mgr.free_holes()):
            return
        layouts = {x.seq_id: x for x in mgr.seq_layouts()}
        reqs = []
        for g in scheduler.running:
            seq = g.seqs[0]
            lay = layouts[seq.seq_id]
            reqs.append({"request_id": g.request_id, "prompt_len": seq.num_prompt_tokens,
                         "computed": lay.num_computed_tokens, "final_len": lay.horizon,
                         "start_block": lay.block_ids[0], "num_blocks": len(lay.block_ids)})
        snap.update(step=s, num_blocks=mgr.num_gpu_blocks, block_size=mgr.block_size, requests=reqs,
                    holes=mgr.free_holes(), head_need_blocks=need)

    simulate(args.workload, "contiguous-max", block_size=16, num_requests=args.num_requests, on_step=on_step)
    return snap or None


def place_paged(snap: dict) -> dict[str, list[int]]:
    """The same requests' tokens placed by a real BlockPool as the engine grows them: each prompt
    at admission (in admission order), then one token per request per decode step."""
    bs = snap["block_size"]
    pool = BlockPool(snap["num_blocks"], enable_caching=False)
    reqs = sorted(snap["requests"], key=lambda r: r["start_block"])
    have = {r["request_id"]: min(r["prompt_len"], r["computed"]) for r in reqs}
    tables = {r["request_id"]: [b.block_id for b in pool.get_new_blocks(cdiv(have[r["request_id"]], bs))]
              for r in reqs}
    while any(have[r["request_id"]] < r["computed"] for r in reqs):
        for r in reqs:
            rid = r["request_id"]
            if have[rid] < r["computed"]:
                have[rid] += 1
                if cdiv(have[rid], bs) > len(tables[rid]):
                    tables[rid].append(pool.get_new_blocks(1)[0].block_id)
    return tables


def cmd_picture(args) -> None:
    snap = snapshot_contiguous(args, args.step)
    if snap is None:  # a short smoke run never saturates after --step: from its start then
        snap = snapshot_contiguous(args, 0)
    if snap is None:
        raise SystemExit("picture: the cache never saturates in this run; use more requests")
    snap["paged_tables"] = place_paged(snap)
    live = sum(r["computed"] for r in snap["requests"])
    reserved = sum(r["num_blocks"] for r in snap["requests"]) * snap["block_size"]
    paged_blocks = sum(len(t) for t in snap["paged_tables"].values())
    ratios = {"num_requests_in_snapshot": len(snap["requests"]), "live_tokens": live,
              "contiguous_max_slots_reserved": reserved, "contiguous_max_token_share": round(live / reserved, 4),
              "paged_slots_used": paged_blocks * snap["block_size"],
              "paged_token_share": round(live / (paged_blocks * snap["block_size"]), 4)}
    write_json(args.results_dir / "sim" / "paging_picture.json", "paging_picture", SIM_DEVICE,
               {"workload": args.workload, "allocator": "contiguous-max", "step": snap["step"],
                "num_requests": args.num_requests}, snap, ratios)
    plots.paging_picture(snap, args.fig_dir / "paging_picture.png")


# ---- Figure 18b ---------------------------------------------------------------------------
def cmd_block_size(args) -> None:
    sizes = [int(x) for x in args.block_sizes.split(",")]
    rates = {"sharegpt-like": args.rate_sharegpt, "alpaca-like": args.rate_alpaca}
    grid = [(w, bs) for w in WORKLOADS for bs in sizes]
    runs = run_sims(args, [dict(workload=w, allocator="paged", block_size=bs, request_rate=rates[w])
                           for w, bs in grid])
    results: dict = {w: {} for w in WORKLOADS}
    for (w, bs), r in zip(grid, runs):
        results[w][str(bs)] = r
    ratios = {}
    for w in WORKLOADS:
        by = results[w]
        if "16" not in by:
            continue
        for bs in by:
            ratios[f"{w}.latency_block{bs}_over_block16"] = round(
                by[bs]["normalized_latency_s_per_token"] / by["16"]["normalized_latency_s_per_token"], 3)
            ratios[f"{w}.token_states_block{bs}"] = round(by[bs]["breakdown"]["token_states"], 4)
    write_json(args.results_dir / "sim" / "block_size.json", "block_size", SIM_DEVICE,
               {"workloads": WORKLOADS, "allocator": "paged", "block_sizes": sizes, "request_rates": rates,
                "kv_budget_tokens": 15_700, "num_requests": args.num_requests}, results, ratios)
    plots.block_size(results, rates, args.fig_dir / "block_size.png")


# ---- Figures 12/13 ------------------------------------------------------------------------
def cmd_load(args) -> None:
    rates = [float(x) for x in args.rates.split(",")]
    grid = [(a, r) for a in ALLOCATORS for r in rates]
    runs = run_sims(args, [dict(workload=args.workload, allocator=a, block_size=16, request_rate=r) for a, r in grid])
    curves: dict = {a: [] for a in ALLOCATORS}
    for (a, rate), r in zip(grid, runs):
        curves[a].append({"rate": rate, **r})
    base = curves["paged"][0]["normalized_latency_s_per_token"]
    sustained = {}
    for factor in (1.5, 2.0, 4.0):
        thr = factor * base
        sustained[f"{factor}x"] = {a: crossing_rate([(p["rate"], p["normalized_latency_s_per_token"]) for p in pts],
                                                    thr) for a, pts in curves.items()}
    main = sustained["2.0x"]
    ratios = {f"rate_vs_{a.replace('-', '_')}": round(main["paged"] / main[a], 2)
              for a in ALLOCATORS[1:] if main.get("paged") and main.get(a)}
    threshold = 2.0 * base
    write_json(args.results_dir / "sim" / "serving_load.json", "serving_load", SIM_DEVICE,
               {"workload": args.workload, "allocators": ALLOCATORS, "rates": rates, "block_size": 16,
                "num_requests": args.num_requests, "latency_threshold_s_per_token": threshold,
                "threshold_rule": "2x paged's normalized latency at the lowest swept rate (also 1.5x and 4x)"},
               {"curves": curves, "sustained_rate": sustained}, ratios)
    plots.serving_load(curves, threshold, main, args.fig_dir / "serving_load.png")


# ---- Figure 15 and the GPU results --------------------------------------------------------
def cmd_sharing(args) -> None:
    import sharing_figure
    sharing_figure.run(args, write_json)


def cmd_gpu(args) -> None:
    import render_gpu
    render_gpu.run(args)


def cmd_all(args) -> None:
    for cmd in (cmd_memory, cmd_picture, cmd_block_size, cmd_load, cmd_sharing, cmd_gpu):
        cmd(args)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("command", choices=["memory", "picture", "block-size", "load", "sharing", "gpu", "all"])
    ap.add_argument("--num-requests", type=int, default=None, help="first N requests (default: the whole workload)")
    ap.add_argument("--jobs", type=int, default=1, help="sim runs in parallel processes")
    ap.add_argument("--fig-dir", type=Path, default=ROOT / "docs" / "figures")
    ap.add_argument("--results-dir", type=Path, default=ROOT / "benchmarks" / "results")
    ap.add_argument("--doc", type=Path, default=ROOT / "docs" / "paper-results.md", help="gpu: doc to fill")
    ap.add_argument("--workload", default="sharegpt-like", help="picture and load")
    ap.add_argument("--step", type=int, default=2000, help="picture: first saturated step from here")
    ap.add_argument("--block-sizes", default="1,8,16,32,64,128,256")
    # Near the knee of paged block 16 (serving_load), where memory decides the batch size.
    ap.add_argument("--rate-sharegpt", type=float, default=2.5, help="block-size: Poisson req/s")
    ap.add_argument("--rate-alpaca", type=float, default=50.0, help="block-size: Poisson req/s")
    ap.add_argument("--rates", default="0.25,0.5,0.75,1,1.25,1.5,1.75,2,2.25,2.5,2.75,3,3.5")
    ap.add_argument("--sharing-requests", type=int, default=16, help="sharing: alpaca-like requests per run")
    ap.add_argument("--sharing-widths", default="2,4,6")
    ap.add_argument("--sharing-model", default=None,
                    help="sharing: a tiny OPT made by tests/tiny_models.py (default: make one, seed 0)")
    args = ap.parse_args(argv)
    {"memory": cmd_memory, "picture": cmd_picture, "block-size": cmd_block_size, "load": cmd_load,
     "sharing": cmd_sharing, "gpu": cmd_gpu, "all": cmd_all}[args.command](args)


if __name__ == "__main__":
    main()
