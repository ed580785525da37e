"""Smoke test of benchmarks/paper/paper_figures.py: every figure command runs on a small workload and
writes a non-empty PNG and its JSON; the GPU renderer fills the doc from paper_gpu.py's JSON shape."""
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FIGURES = ["memory_breakdown", "paging_picture", "block_size", "serving_load", "sharing_memory",
           "h200_serving_load"]


def test_all_figure_commands_write_pngs_and_json(tmp_path, tiny_model_dir):
    res, fig, doc = tmp_path / "results", tmp_path / "figures", tmp_path / "paper-results.md"
    # The shape benchmarks/paper/paper_gpu.py writes for serving_load; the other GPU files are absent.
    curves = {a: [{"rate": r, "normalized_latency_s_per_token": lat, "avg_batched_requests": 2 * r} for r, lat in pts]
              for a, pts in {"paged": [(4, 0.02), (8, 0.03)], "contiguous-max": [(4, 0.05), (8, 0.4)]}.items()}
    (res / "h200").mkdir(parents=True)
    (res / "h200" / "serving_load.json").write_text(json.dumps(
        {"device": "NVIDIA H200", "commit": "abc", "date": "2025-01-01", "command": "python benchmarks/paper/paper_gpu.py",
         "config": {"model": "opt-13b", "latency_threshold_s_per_token": 0.04},
         "results": {"curves": curves, "sustained_rate": {"paged": 8.0, "contiguous-max": None}},
         "ratios": {}}))
    doc.write_text("# x\n<!-- gpu:serving_load -->\nSTALE-BODY\n<!-- /gpu:serving_load -->\n"
                   "<!-- gpu:block_size -->\nSTALE-BODY\n<!-- /gpu:block_size -->\n")
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "paper" / "paper_figures.py"), "all", "--num-requests", "12",
         "--rates", "1,4", "--block-sizes", "16,64", "--sharing-requests", "1", "--sharing-widths", "2",
         "--sharing-model", str(tiny_model_dir("opt")),
         "--fig-dir", str(fig), "--results-dir", str(res), "--doc", str(doc)],
        capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for name in FIGURES:
        png = fig / f"{name}.png"
        assert png.exists() and png.stat().st_size > 10_000, name
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    for rel in ("sim/memory_breakdown.json", "sim/paging_picture.json", "sim/block_size.json",
                "sim/serving_load.json", "cpu/sharing_memory.json"):
        d = json.loads((res / rel).read_text())
        assert d["command"].startswith("python benchmarks/paper/paper_figures.py all") and d["results"], rel
    mem = json.loads((res / "sim/memory_breakdown.json").read_text())["results"]
    for workload in ("sharegpt-like", "alpaca-like"):
        for alloc, r in mem[workload].items():
            assert abs(sum(r["breakdown"].values()) - 1) < 1e-9, (workload, alloc)
    text = doc.read_text()
    assert "STALE-BODY" not in text and "figures/h200_serving_load.png" in text and "| paged | 8.00 |" in text
    assert "Not measured yet" in text  # block_size.json is absent
