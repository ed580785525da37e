"""The roofline's cost model for mixtures of experts: total and active parameters from the real
configs (the published figures), and the weight bytes a step reads growing with the experts its
tokens touch, from the dense part alone at zero tokens to every expert for a large batch."""
import itertools
from pathlib import Path

import pytest

from pagedserve.benchmark.roofline import ModelCost, experts_touched
from pagedserve.models.loader import load_hf_config

MODELS = Path(__file__).resolve().parents[2] / "benchmarks" / "models"


@pytest.mark.parametrize("name,total_b,active_b", [
    # Published: Qwen3-30B-A3B 30.5B total / 3.3B active, Mixtral-8x7B 46.7B / 12.9B, both with the
    # input embedding, which the roofline leaves out (it is gathered, not multiplied).
    ("qwen3-30b-a3b", 30.5 - 0.31, 3.3 - 0.31), ("mixtral-8x7b", 46.7 - 0.13, 12.9 - 0.13)])
def test_total_and_active_params_of_real_configs(name, total_b, active_b):
    cost = ModelCost.from_hf_config(load_hf_config(MODELS / name))
    assert cost.total_params / 1e9 == pytest.approx(total_b, rel=0.02)
    assert cost.active_params / 1e9 == pytest.approx(active_b, rel=0.05)


def test_step_bytes_count_the_experts_touched():
    cost = ModelCost.from_hf_config(load_hf_config(MODELS / "qwen3-30b-a3b"))
    assert cost.step_weight_bytes(0) == cost.weight_bytes
    one = cost.step_weight_bytes(1) - cost.weight_bytes
    assert one == pytest.approx(8 * cost.expert_bytes)  # one token reads its top-8 experts per layer
    every = cost.weight_bytes + 128 * cost.expert_bytes
    assert cost.step_weight_bytes(8) < cost.step_weight_bytes(64) < every
    assert cost.step_weight_bytes(4096) == pytest.approx(every)


@pytest.mark.parametrize("n,E,k", [(1, 5, 2), (2, 4, 2), (3, 5, 2), (2, 6, 3)])
def test_experts_touched_equals_enumeration(n, E, k):
    """The expectation against the average over every routing of n tokens (top-k distinct each)."""
    choices = list(itertools.combinations(range(E), k))
    routings = list(itertools.product(choices, repeat=n))
    mean = sum(len(set().union(*r)) for r in routings) / len(routings)
    assert experts_touched(n, E, k) == pytest.approx(mean)


def test_dense_models_unchanged():
    cost = ModelCost.from_hf_config(load_hf_config(MODELS / "llama-3.1-8b"))
    assert cost.expert_bytes == 0 and cost.step_weight_bytes(256) == cost.weight_bytes
    assert cost.total_params == cost.active_params


def test_sim_step_time_reads_what_the_roofline_reads():
    """pagedserve.sim's step-time model built from a MoE ModelCost charges a step the roofline's
    bytes (dense weights, the experts its tokens touch, the KV) plus the active params' FLOPs."""
    from pagedserve.sim import StepTimeModel, simulate
    cost = ModelCost.from_hf_config(load_hf_config(MODELS / "qwen3-30b-a3b"))
    bw, rate = 4.0e12, 800e12
    tm = StepTimeModel.from_model_cost(cost, bw, rate)
    for n, ctx in ((1, 500), (16, 8000), (256, 100_000)):
        memory = (cost.step_weight_bytes(n) + ctx * cost.kv_bytes_per_token) / bw
        assert tm.step_time(n, ctx) - n * tm.per_token == pytest.approx(memory)
    assert tm.per_token == pytest.approx(2 * cost.active_params / (0.5 * rate))
    out = simulate(workload="sharegpt-like", num_requests=20, time_model=tm)
    assert out["num_finished"] == 20 and out["step_time_model"]["num_experts"] == 128


def test_sim_cli_takes_a_model_dir(tmp_path):
    """`pagedserve sim --model DIR` times steps by that config (read as JSON: no torch), here
    Qwen3-30B-A3B on an H200, and rejects a directory without a config, naming it."""
    import json
    import subprocess
    import sys
    out = tmp_path / "sim.json"
    cmd = [sys.executable, "-m", "pagedserve.entrypoints.cli", "sim", "--num-requests", "30",
           "--model", str(MODELS / "qwen3-30b-a3b"), "--output", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    doc = json.loads(out.read_text())
    tm = doc["results"]["step_time_model"]
    assert tm["num_experts"] == 128 and tm["top_k"] == 8 and doc["config"]["model"].endswith("qwen3-30b-a3b")
    assert tm["kv_bytes_per_token"] == 48 * 2 * 4 * 128 * 2
    bad = subprocess.run(cmd[:-4] + ["--model", str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert bad.returncode != 0 and "config.json" in bad.stderr
