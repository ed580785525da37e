"""crossing_rate: the rate a load sweep sustains under a latency threshold."""
import pytest

from pagedserve.benchmark.sustained import crossing_rate


def test_interpolates_between_the_last_point_under_and_the_first_over():
    # 0.02 at rate 4, 0.06 at rate 8: threshold 0.03 is a quarter of the way, rate 5.
    assert crossing_rate([(1, 0.01), (4, 0.02), (8, 0.06), (12, 0.5)], 0.03) == pytest.approx(5.0)


def test_a_point_exactly_at_the_threshold_is_sustained():
    assert crossing_rate([(1, 0.01), (4, 0.03), (8, 0.06)], 0.03) == pytest.approx(4.0)


def test_every_point_under_gives_the_highest_rate_swept():
    assert crossing_rate([(1, 0.01), (2, 0.02)], 0.05) == 2


def test_first_point_over_gives_none_and_a_later_dip_does_not_count():
    assert crossing_rate([(1, 0.09), (2, 0.01)], 0.05) is None
    assert crossing_rate([(1, 0.01), (2, 0.09), (3, 0.01)], 0.05) == pytest.approx(1 + (0.05 - 0.01) / 0.08)
