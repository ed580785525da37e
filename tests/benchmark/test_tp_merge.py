"""tp_bench --merge: one tp.json from the partial files of runs cut into several device calls."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _part(tmp: Path, name: str, commit: str, results: dict, device: str | None, command: bool = True,
          switches: dict | None = None) -> Path:
    doc = {"config": {"commit": commit, "dtype": "bfloat16"}, "results": results, "ratios": {}}
    if switches is not None:
        doc["switches"] = switches
    if device:
        doc["device"] = device
    if command:
        doc["command"] = f"python benchmarks/distributed/tp_bench.py --out {name}"
    path = tmp / name
    path.write_text(json.dumps(doc))
    return path


def _merge(*paths: Path, out: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "benchmarks" / "distributed" / "tp_bench.py"), "--merge", *map(str, paths),
                           "--out", str(out)], capture_output=True, text=True, cwd=ROOT, timeout=120)


def test_merge_unites_partial_runs_and_keeps_their_device_and_commit(tmp_path):
    commit = "a" * 40
    tp1 = {"fixed256_llama-3.1-8b": {"tp1": {"total_tokens_per_s": 100.0}}}
    tp2 = {"fixed256_llama-3.1-8b": {"tp2": {"total_tokens_per_s": 150.0}},
           "errors": {"opt-13b-tp1": "opt-13b-tp1 timed out"}}
    a = _part(tmp_path, "a.partial.json", commit, tp1, None, command=False)  # a cut-off run: no command, no device
    b = _part(tmp_path, "b.json", commit, tp2, "NVIDIA H200")
    out = tmp_path / "tp.json"
    r = _merge(a, b, out=out)
    assert r.returncode == 0, r.stderr
    doc = json.loads(out.read_text())
    assert doc["results"]["fixed256_llama-3.1-8b"] == {"tp1": {"total_tokens_per_s": 100.0},
                                                       "tp2": {"total_tokens_per_s": 150.0}}
    assert doc["ratios"]["tp2_over_tp1_throughput"] == 1.5
    assert doc["results"]["errors"] == {"opt-13b-tp1": "opt-13b-tp1 timed out"}
    assert doc["device"] == "NVIDIA H200" and doc["commit"] == commit
    assert "tp.partial.json of a run that ended" in doc["config"]["merged_from"][0]


def test_merge_refuses_runs_of_different_commits(tmp_path):
    a = _part(tmp_path, "a.json", "a" * 40, {}, "NVIDIA H200")
    b = _part(tmp_path, "b.json", "b" * 40, {}, "NVIDIA H200")
    r = _merge(a, b, out=tmp_path / "tp.json")
    assert r.returncode != 0 and "different commits" in r.stderr
    assert not (tmp_path / "tp.json").exists()


def test_merge_keeps_the_runs_switches_and_refuses_different_ones(tmp_path):
    commit = "a" * 40
    symm = {"PAGEDSERVE_TP_ALLREDUCE": "symm_mem"}
    a = _part(tmp_path, "a.json", commit, {}, "NVIDIA H200", switches=symm)
    b = _part(tmp_path, "b.json", commit, {}, "NVIDIA H200", switches=symm)
    nccl = _part(tmp_path, "c.json", commit, {}, "NVIDIA H200", switches={"PAGEDSERVE_TP_ALLREDUCE": None})
    out = tmp_path / "tp.json"
    r = _merge(a, b, out=out)  # the merging shell has no PAGEDSERVE_TP_ALLREDUCE: the runs' value wins
    assert r.returncode == 0, r.stderr
    assert json.loads(out.read_text())["switches"]["PAGEDSERVE_TP_ALLREDUCE"] == "symm_mem"
    r = _merge(a, nccl, out=tmp_path / "mixed.json")
    assert r.returncode != 0 and "different switches" in r.stderr
    assert not (tmp_path / "mixed.json").exists()
