"""profile_decode's idle-gap accounting: merged device spans, gaps bucketed by length."""
import importlib.util
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "kernels"
sys.path.insert(0, str(BENCH.parent / "offline"))  # profile_decode imports host_overhead from benchmarks/offline/
spec = importlib.util.spec_from_file_location("profile_decode", BENCH / "profile_decode.py")
profile_decode = importlib.util.module_from_spec(spec)
spec.loader.exec_module(profile_decode)


def test_idle_gaps_merge_overlapping_spans():
    # [0,10] and [5,12] overlap (a copy beside a kernel): no gap; then 2 us, 30 us, 100 us.
    spans = [(0.0, 10.0), (5.0, 12.0), (14.0, 20.0), (50.0, 60.0), (55.0, 58.0), (160.0, 161.0)]
    assert profile_decode.idle_gaps(spans) == [2.0, 30.0, 100.0]
    assert profile_decode.idle_gaps([]) == []


def test_gap_buckets_per_step():
    got = profile_decode.gap_buckets([2.0, 3.0, 30.0, 100.0, 4.0, 60.0], steps=2)
    assert got["0-5us"] == {"count_per_step": 1.5, "ms_per_step": pytest.approx(0.0045)}
    assert got["5-50us"] == {"count_per_step": 0.5, "ms_per_step": pytest.approx(0.015)}
    assert got[">=50us"] == {"count_per_step": 1.0, "ms_per_step": pytest.approx(0.08)}
