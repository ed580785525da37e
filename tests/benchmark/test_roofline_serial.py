"""The two rooflines of an executed schedule: ideal_seconds overlaps every step's memory-bound and
compute-bound work (max per step), serial_ideal_seconds runs its matmuls and its attention one
after the other, each at its own bound (sum per step), as the engines do. Checked by hand on one
step, as invariants over random schedules, and on Llama-3.1-8B's config at fixed256's decode."""
import random

import pytest

from pagedserve.benchmark.roofline import ModelCost, StepLog, StepRecord
from pagedserve.models.loader import load_hf_config

COST = ModelCost(weight_bytes=1000, matmul_params=400, lm_head_params=100, kv_bytes_per_token=10,
                 attn_flops_per_pair=8)


def test_one_step_by_hand():
    log = StepLog([StepRecord(num_tokens=4, num_sampled=4, context_tokens=50, attended_pairs=200)])
    bw, rate = 100.0, 1000.0
    weights, kv = 1000 / bw, 50 * 10 / bw                     # 10 s, 5 s
    matmul, attn = (2 * 400 * 4 + 2 * 100 * 4) / rate, 8 * 200 / rate   # 4 s, 1.6 s
    assert log.ideal_seconds(COST, bw, rate) == pytest.approx(max(weights + kv, matmul + attn))
    assert log.serial_ideal_seconds(COST, bw, rate) == pytest.approx(max(weights, matmul) + max(kv, attn))


def test_serial_is_never_below_ideal_and_equal_without_context():
    rng = random.Random(0)
    for _ in range(200):
        steps = [StepRecord(t, rng.randint(1, t), rng.randint(0, 5000), rng.randint(0, 50000))
                 for t in (rng.randint(1, 512) for _ in range(rng.randint(1, 5)))]
        bw, rate = rng.uniform(10, 1000), rng.uniform(10, 1e4)
        log = StepLog(steps)
        assert log.serial_ideal_seconds(COST, bw, rate) >= log.ideal_seconds(COST, bw, rate) - 1e-12
        empty = StepLog([StepRecord(s.num_tokens, s.num_sampled, 0, 0) for s in steps])
        assert empty.serial_ideal_seconds(COST, bw, rate) == pytest.approx(empty.ideal_seconds(COST, bw, rate))


def test_a_large_decode_batch_of_llama_8b_is_compute_bound_in_gemms_and_memory_bound_in_attention():
    """1,000 decodes at 400 tokens of context on the H200's measured rates (4.26 TB/s, 797 TFLOPS):
    the overlapped bound is the GEMMs alone, the serial one adds attention's KV read, so a step
    run layer by layer cannot reach the overlapped roofline's 0.65 without overlapping them."""
    cost = ModelCost.from_hf_config(load_hf_config("benchmarks/models/llama-3.1-8b"))
    step = StepLog([StepRecord(1000, 1000, 1000 * 400, 1000 * 400)])
    bw, rate = 4.26e12, 797e12
    gemms = (2 * cost.matmul_params * 1000 + 2 * cost.lm_head_params * 1000) / rate
    kv = 1000 * 400 * cost.kv_bytes_per_token / bw
    assert cost.step_weight_bytes(1000) / bw < gemms and cost.attn_flops_per_pair * 400_000 / rate < kv
    assert step.serial_ideal_seconds(cost, bw, rate) == pytest.approx(gemms + kv)
    assert step.ideal_seconds(cost, bw, rate) == pytest.approx(gemms + cost.attn_flops_per_pair * 400_000 / rate)
    assert step.ideal_seconds(cost, bw, rate) / step.serial_ideal_seconds(cost, bw, rate) < 0.65


def test_fixed256s_recorded_roofline_and_its_serial_bound():
    """serving.json's fixed256 best run (the second: 240 of each 256-token prompt cached) is one
    16,000-token step (1,000 prompts' last 16 tokens) then 255 steps of 1,000 decodes: its
    schedule rebuilt here gives the recorded roofline_ideal_seconds, and its serial bound is
    above the time #35's target (roofline fraction 0.65) asks for: no engine that runs a layer's
    GEMMs and attention one after the other can meet it."""
    import json
    from pathlib import Path
    doc = json.loads((Path(__file__).resolve().parents[2] / "benchmarks/results/h200/serving.json").read_text())
    run = doc["results"]["offline"]["pagedserve"]["fixed256"]
    assert run["num_steps"] == 256 and run["runs"][-1]["prefix_cache_hit_tokens"] == 240_000
    steps = [StepRecord(16_000, 1000, 1000 * 256, 1000 * sum(241 + i for i in range(16)))]
    steps += [StepRecord(1000, 1000, 1000 * (256 + k), 1000 * (256 + k)) for k in range(1, 256)]
    cost = ModelCost.from_hf_config(load_hf_config("benchmarks/models/llama-3.1-8b"))
    bw, rate = run["measured_copy_bandwidth_GBps"] * 1e9, run["measured_matmul_TFLOPs"] * 1e12
    log = StepLog(steps)
    assert log.ideal_seconds(cost, bw, rate) == pytest.approx(run["roofline_ideal_seconds"], abs=0.01)
    serial = log.serial_ideal_seconds(cost, bw, rate)
    assert serial > run["roofline_ideal_seconds"] / 0.65      # 8.25 s against 8.19 s (ba7b152's lease)
