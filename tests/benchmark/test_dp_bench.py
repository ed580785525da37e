"""dp_bench's rate at saturation: from the timeline's counter samples, only the intervals at
which every replica had a queue count (benchmarks/distributed/dp_bench.py, saturated_rate)."""
import importlib.util
import statistics
from pathlib import Path

import pytest

spec = importlib.util.spec_from_file_location("dp_bench", Path(__file__).resolve().parents[2] / "benchmarks/distributed/dp_bench.py")
dp_bench = importlib.util.module_from_spec(spec)
spec.loader.exec_module(dp_bench)


def sample(t, **replicas):
    """replicas: label=(waiting, output_tokens)"""
    return {"t": t, "t_metrics": t, "cpu_share": {},
            "requests": {k: {"running": 4.0, "waiting": float(w), "output_tokens": float(n)}
                         for k, (w, n) in replicas.items()}}


def test_only_intervals_where_every_replica_waited_count():
    samples = [
        sample(0.0, r0=(5, 0), r1=(5, 0)),
        sample(1.0, r0=(5, 100), r1=(4, 120)),      # 220 tok/s
        sample(2.0, r0=(3, 250), r1=(2, 250)),      # 280 tok/s
        {"t": 3.0, "t_metrics": 3.0, "cpu_share": {}, "requests": {"error": "ReadTimeout"}},
        sample(4.0, r0=(2, 500), r1=(1, 500)),      # after an error sample: no interval
        sample(6.0, r0=(1, 900), r1=(1, 860)),      # 2 s: 760 / 2 = 380 tok/s
        sample(7.0, r0=(0, 1000), r1=(1, 960)),     # r0 drained: excluded
        sample(8.0, r0=(0, 1100), r1=(0, 1000)),
    ]
    got = dp_bench.saturated_rate(samples)
    assert got["intervals"] == 3
    assert got["seconds"] == pytest.approx(4.0)
    assert got["median_output_throughput"] == pytest.approx(statistics.median([220, 280, 380]))
    # The mean weighs each interval by its length: all tokens over all seconds.
    assert got["mean_output_throughput"] == pytest.approx((220 + 280 + 760) / 4.0)


def test_a_replica_appearing_later_or_no_queue_at_all_gives_nothing():
    one = sample(0.0, r0=(5, 0))
    two = sample(1.0, r0=(5, 100), r1=(5, 100))  # the replica set changed: not comparable
    assert dp_bench.saturated_rate([one, two]) is None
    idle = [sample(0.0, r0=(0, 0)), sample(1.0, r0=(0, 50))]
    assert dp_bench.saturated_rate(idle) is None


def test_plain_server_without_replica_label():
    samples = [sample(0.0, **{"-": (9, 1000)}), sample(0.5, **{"-": (9, 1600)}), sample(1.5, **{"-": (8, 2600)})]
    got = dp_bench.saturated_rate(samples)
    assert got["median_output_throughput"] == pytest.approx(statistics.median([1200, 1000]))
    assert got["mean_output_throughput"] == pytest.approx(1600 / 1.5)
