"""`pagedserve bench serve` replays a workload against a real server and reports its numbers."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from server_process import REPO, start_server, stop_server
from pagedserve.workloads import make_workload


@pytest.fixture(scope="module")
def wide_server(tiny_model_dir, tmp_path_factory):
    """Workload prompts draw ids from [0, 10000): a tiny model with a vocab that wide."""
    model = tiny_model_dir("llama", vocab_size=10240, max_position_embeddings=2048)
    s = start_server(model, tmp_path_factory.mktemp("bench") / "server.log",
                     "--max-model-len", "2048", "--num-gpu-blocks-override", "512",
                     "--swap-space", "0.05")
    yield s
    stop_server(s)


def test_bench_serve_against_server(wide_server, tmp_path):
    out = tmp_path / "bench.json"
    n, rate = 8, 50.0
    cmd = [sys.executable, "-m", "pagedserve.entrypoints.cli", "bench", "serve",
           "--base-url", wide_server.v1, "--workload", "alpaca-like", "--num-requests", str(n),
           "--request-rate", str(rate), "--output", str(out)]
    env = dict(os.environ, PYTHONPATH=str(REPO))
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr + wide_server.log()
    assert "output throughput" in p.stdout
    doc = json.loads(out.read_text())
    assert doc["commit"] and doc["command"].startswith("pagedserve bench serve --base-url")
    res = doc["results"]
    work = make_workload("alpaca-like", n, rate)
    assert res["completed"] == n and res["failed"] == 0
    # ignore_eos and max_tokens = output_len: the server produced exactly the workload's tokens
    assert [r["output_len"] for r in res["requests"]] == [w.output_len for w in work]
    assert [r["prompt_len"] for r in res["requests"]] == [len(w.prompt_token_ids) for w in work]
    assert res["total_output_tokens"] == sum(w.output_len for w in work)
    for key in ("ttft_ms", "tpot_ms", "e2e_latency_ms"):
        assert set(res[key]) == {"mean", "p50", "p90", "p99"}
        assert 0 < res[key]["p50"] <= res[key]["p90"] <= res[key]["p99"]
    assert res["request_throughput"] > 0 and res["output_throughput"] > 0
    assert doc["config"]["request_rate"] == rate
