"""Smoke run of benchmarks/serving/serve_vs_offline.py: a real server and the offline engine on the demo
model, 48 streams of a few tokens; both sides produce every token and the same greedy text."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_serve_vs_offline_smoke(tmp_path):
    out = tmp_path / "serve_vs_offline.json"
    env = dict(os.environ, PYTHONPATH=f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
               OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    r = subprocess.run([sys.executable, str(REPO / "benchmarks" / "serving" / "serve_vs_offline.py"),
                        "--num-streams", "48", "--max-tokens", "4", "--output", str(out)],
                       env=env, capture_output=True, text=True, timeout=400)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(out.read_text())
    assert res["server_tokens"] == res["offline_tokens"] == 48 * 4
    assert res["same_text"] == 48
    assert res["server_wall_s"] > 0 and res["offline_wall_s"] > 0
    assert res["server_over_offline"] == res["server_wall_s"] / res["offline_wall_s"]
    assert res["commit"] == "unknown" or len(res["commit"]) == 40
