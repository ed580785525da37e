"""benchmarks/serving/vs_vllm.py collect: the phase files of one lease become serving.json with the
issue's ratios, the measured commit and the GPU machine's host (not the collecting machine's).
The phase files are the headline lease's own (benchmarks/results/h200/serving_runs_0a88c13/): collected
again, they give the committed benchmarks/results/h200/serving.json's figures exactly, so every
ratio the README cites follows from the files beside it."""
import json
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LEASE = ROOT / "benchmarks/results/h200/serving_runs_0a88c13"
COMMITTED = ROOT / "benchmarks/results/h200/serving.json"


def test_collect_computes_ratios_from_the_phase_files(tmp_path):
    work = tmp_path / "work"
    work.mkdir()
    for f in LEASE.glob("o*.json"):
        shutil.copy(f, work / f.name)
    out = tmp_path / "serving.json"
    subprocess.run([sys.executable, str(ROOT / "benchmarks/serving/vs_vllm.py"), "collect", "--work", str(work),
                    "--device", "NVIDIA H200", "--gpus", "0", "--output", str(out)],
                   check=True, capture_output=True, text=True, cwd=ROOT)
    got = json.loads(out.read_text())
    phase = {n: json.loads((LEASE / f"online_{n}_r20.json").read_text())["results"] for n in ("pagedserve", "vllm")}
    assert got["ratios"]["tpot_p50_over_vllm_r20"] == round(
        phase["pagedserve"]["tpot_ms"]["p50"] / phase["vllm"]["tpot_ms"]["p50"], 3)
    assert got["ratios"]["throughput_over_vllm_r20"] == round(
        phase["pagedserve"]["request_throughput"] / phase["vllm"]["request_throughput"], 3)
    ours = json.loads((LEASE / "offline_pagedserve_nanovllm.json").read_text())["results"]["output_tokens_per_s"]
    theirs = json.loads((LEASE / "offline_vllm_nanovllm.json").read_text())["results"]["output_tok_s"]
    assert got["ratios"]["offline_nanovllm_over_vllm"] == round(ours / theirs, 3)
    r10 = json.loads((LEASE / "online_pagedserve_r10.json").read_text())
    assert got["commit"] == r10["commit"]  # the code the phases ran
    committed = json.loads(COMMITTED.read_text())
    assert got["date"] == r10["date"] == committed["date"]  # the lease's day, not the collecting one's
    assert got["host"] == committed["host"] and got["host"]["cpu"] in {  # the GPU machine's, from its phases
        json.loads(f.read_text()).get("host", {}).get("cpu") for f in LEASE.glob("o*.json")}
    assert got["ratios"] == committed["ratios"] and got["results"] == committed["results"]


def test_online_runs_the_client_with_the_processes_asked_for(monkeypatch, tmp_path):
    """--client-processes reaches `pagedserve bench serve` (and 1, the default, is passed as 1)."""
    import argparse
    sys.path.insert(0, str(ROOT / "benchmarks/serving"))
    import vs_vllm
    seen = []

    def fake_run(cmd, **kw):
        seen.append(cmd)
        return subprocess.CompletedProcess(cmd, 0, "completed 1", "")
    monkeypatch.setattr(vs_vllm.subprocess, "run", fake_run)
    for k in (1, 3):
        args = argparse.Namespace(workload="sharegpt-like", site=str(tmp_path), rate_limit=10, client_processes=k)
        vs_vllm.bench_serve(args, "pagedserve", 8200, 10.0, 5, tmp_path / "o.json", tmp_path, tmp_path)
        cmd = seen[-1]
        assert cmd[cmd.index("--num-client-processes") + 1] == str(k)
