"""benchmarks/offline/offline_steps.py's arithmetic (the GPU run itself needs CUDA): each traced step's
roofline from the model's cost, and the grouping of a run's steps."""
import importlib.util
import sys
from pathlib import Path

import pytest

from pagedserve.benchmark.roofline import ModelCost

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks" / "offline"))
spec = importlib.util.spec_from_file_location("offline_steps", ROOT / "benchmarks/offline/offline_steps.py")
offline_steps = importlib.util.module_from_spec(spec)
spec.loader.exec_module(offline_steps)

COST = ModelCost(weight_bytes=1000, matmul_params=10, lm_head_params=5, kv_bytes_per_token=2, attn_flops_per_pair=3)


def step(seqs, decodes, tokens, context, busy_ms, gap_ms=0.0):
    return dict(seqs=seqs, decodes=decodes, tokens=tokens, context=context, busy_ms=busy_ms, gap_ms=gap_ms)


def test_decode_step_roofline_is_bytes_or_flops_whichever_is_longer():
    s = step(4, 4, 4, 100, 1.0)
    # bytes: weights 1000 + 100 context tokens x 2; FLOPs: 2x10x4 tokens + 2x5x4 sampled + 3x100 pairs
    assert offline_steps.step_ideal_s(s, COST, bandwidth=1200.0, flops_rate=1e9) == pytest.approx(1.0)
    assert offline_steps.step_ideal_s(s, COST, bandwidth=1e9, flops_rate=420.0) == pytest.approx(1.0)


def test_steps_group_by_batch_and_prefill_tokens():
    steps = [step(30, 30, 30, 3000, 2.0), step(40, 40, 40, 4000, 3.0, 0.5), step(5, 4, 1500, 2000, 10.0, None)]
    out = offline_steps.summarise(steps, wall_s=0.02, cost=COST, bandwidth=1e6, flops_rate=1e12,
                                  bin_seqs=32, bin_tokens=2048)
    assert list(out["groups"]) == ["decode 1-32", "decode 33-64", "mixed 1-2048 tokens"]
    assert out["groups"]["decode 33-64"]["steps"] == 1 and out["groups"]["decode 33-64"]["busy_s"] == 0.003
    assert out["busy_s"] == 0.015 and out["gap_s"] == 0.0005 and out["outside_steps_s"] == pytest.approx(0.0045, abs=1e-3)
    # bandwidth-bound here: (1000 + 2 x 3000) bytes at 1e6 B/s for the first step, 7 ms against its 2 ms busy
    assert out["groups"]["decode 1-32"]["ideal_s"] == pytest.approx(0.007)
    assert out["groups"]["decode 1-32"]["share_of_busy"] == pytest.approx(2 / 15, abs=1e-3)
