"""benchmarks/paper/paper_gpu.py end to end on CPU with a tiny model: every section runs, writes
docs/benchmarks.md's JSON, and its derived numbers follow from its own measurements. The H200 run
uses the same code with real configs; this catches a broken script before device time is spent."""
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_every_section_runs_and_writes_consistent_json(tmp_path, tiny_model_dir):
    model = tiny_model_dir("llama", max_position_embeddings=8192)
    out = tmp_path / "h200"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "paper" / "paper_gpu.py"), "--device", "cpu", "--dtype", "float32",
           "--out-dir", str(out), "--max-output", "6",
           "--model", str(model), "--kv-budget-gb", "0.002", "--rates", "8,50", "--window-s", "0.1",
           "--min-requests", "3",
           "--bs-model", str(model), "--block-sizes", "8,16", "--bs-requests", "4", "--bs-max-model-len", "512",
           "--svr-tokens", "100",
           "--sp-model", str(model), "--sp-users", "3", "--sp-rate", "50", "--sp-prefix-len", "1000",
           "--mem-requests", "8", "--mem-steps", "12"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]

    mem = json.loads((out / "memory_breakdown.json").read_text())
    for w in ("sharegpt-like", "alpaca-like"):
        for alloc, r in mem["results"][w].items():
            # The engine, given the sim's requests and settings, makes the sim's decisions step by
            # step, so every share of the memory split is the same number at every step.
            assert r["steps_gpu"] == r["steps_sim"] == 12, (w, alloc)
            assert r["max_abs_step_difference"] == 0.0, (w, alloc)
            assert r["breakdown_gpu_engine"] == r["breakdown_sim"], (w, alloc)
    assert mem["results"]["sharegpt-like"]["contiguous-max"]["breakdown_sim"]["internal_fragmentation"] > 0.2

    load = json.loads((out / "serving_load.json").read_text())
    assert load["command"].startswith("python benchmarks/paper/paper_gpu.py --device cpu")
    curves, cfg = load["results"]["curves"], load["config"]
    assert list(curves) == ["paged", "contiguous-oracle", "contiguous-max", "contiguous-pow2"]
    assert cfg["latency_threshold_s_per_token"] == 2 * curves["paged"][0]["normalized_latency_s_per_token"]
    for alloc, pts in curves.items():
        # Each allocator stops at its first point above the threshold, and not before (one above
        # it at the lowest rate gets one more point at half that rate).
        over = [p["normalized_latency_s_per_token"] > cfg["latency_threshold_s_per_token"] for p in pts]
        assert over == sorted(over), alloc
        assert sum(over) <= 1 or [p["rate"] for p in pts] == [4, 8], alloc
        assert len(pts) == 2 or over[-1] or pts[0]["rate"] == 4, alloc
        assert [p["num_requests"] for p in pts if p["rate"] == 8] == [3], alloc  # min_requests > 8 req/s x 0.1 s
    sustained = load["results"]["sustained_rate"]
    for key, alloc in (("rate_vs_contiguous_oracle", "contiguous-oracle"), ("rate_vs_contiguous_max", "contiguous-max")):
        assert load["ratios"][key] == round(sustained["paged"] / sustained[alloc], 2)

    bs = json.loads((out / "block_size.json").read_text())["results"]["by_block_size"]
    assert set(bs) == {"8", "16"} and all(r["num_requests"] == 4 for r in bs.values())
    assert bs["8"]["peak_blocks_used"] >= bs["16"]["peak_blocks_used"]  # smaller blocks, more of them
    svr = json.loads((out / "swap_vs_recompute.json").read_text())
    assert {r["blocks"] for r in svr["results"]["by_block_size"].values()} == {13, 7}  # ceil(100 / 8), ceil(100 / 16)
    assert svr["ratios"]["swap_over_recompute_block16"] > 0

    sp = json.loads((out / "shared_prefix.json").read_text())
    cached, uncached = sp["results"]["cached"], sp["results"]["uncached"]
    # 3 users x 1,000 shared tokens (the paper's 5,000 prefills for 30 s on a CPU): with caching the
    # prefix's blocks are stored once.
    assert sp["config"]["prefix_len"] == 1000
    assert uncached["prefix_cache_hits"] == 0 and cached["prefix_cache_hits"] > 0
    assert cached["peak_blocks_used"] < uncached["peak_blocks_used"]
    assert sp["ratios"]["kv_blocks_saved_fraction"] == round(
        1 - cached["peak_blocks_used"] / uncached["peak_blocks_used"], 3)
