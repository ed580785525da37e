"""benchmarks/serving/peers/decode_step_diff.py on CPU: pagedserve through its public LLM, the plumbing the
GPU run uses for both engines (the exact token counts of every run are checked by the script)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_decode_step_diff_runs_pagedserve_on_cpu(tmp_path):
    """Two batch sizes on one engine, a file each, with an engine argument passed through."""
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks/serving/peers/decode_step_diff.py"), "--engine", "pagedserve",
                        "--device", "cpu", "--config", str(ROOT / "pagedserve/demo_model/config.json"),
                        "--num-seqs", "3", "2", "--prompt-len", "24", "--short", "2", "--long", "5", "--repeat", "1",
                        "--dtype", "float32", "--max-model-len", "256", "--token-id-limit", "2000",
                        "--pagedserve-kwargs", '{"max_num_seqs": 4}',
                        "--out", str(tmp_path / "d_{n}.json")], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    from pagedserve.benchmark.results import git_commit
    for n in (3, 2):
        doc = json.loads((tmp_path / f"d_{n}.json").read_text())
        assert doc["engine"] == "pagedserve" and doc["commit"] == git_commit()  # (+dirty in a dirty tree)
        assert doc["config"]["num_seqs"] == n and doc["pagedserve_kwargs"] == {"max_num_seqs": 4}
        assert set(doc["results"]["wall_s"]) == {"2", "5"} and "step_period_ms" in doc["results"]
        assert "kernels_per_step" not in doc["results"]  # no CUDA, no kernel table


def test_several_sizes_need_a_file_pattern(tmp_path):
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks/serving/peers/decode_step_diff.py"), "--engine", "pagedserve",
                        "--device", "cpu", "--num-seqs", "2", "3", "--out", str(tmp_path / "d.json")],
                       capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert r.returncode == 2 and '{n}' in r.stderr


def test_decode_step_diff_refuses_vllm_with_its_core_in_another_process(tmp_path):
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks/serving/peers/decode_step_diff.py"), "--engine", "vllm"],
                       capture_output=True, text=True, cwd=ROOT, timeout=120,
                       env={"PATH": "/usr/bin:/bin", "VLLM_ENABLE_V1_MULTIPROCESSING": "1"})
    assert r.returncode != 0 and "VLLM_ENABLE_V1_MULTIPROCESSING=0" in r.stderr
