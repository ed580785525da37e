"""The request rate a system sustains in a load sweep (the paper's Figures 12/13), shared by the
simulator's figure and the GPU one."""
from __future__ import annotations


def crossing_rate(points: list[tuple[float, float]], threshold: float) -> float | None:
    """The highest rate whose normalized latency stays <= threshold, linear between the sweep's
    (rate, latency) points in rising rate order; None if even the lowest rate is above it.

    The sweep stops at the first point above the threshold: a later dip below it does not count."""
    best = None
    for i, (r0, l0) in enumerate(points):
        if l0 > threshold:
            break
        best = r0
        if i + 1 < len(points) and points[i + 1][1] > threshold:
            r1, l1 = points[i + 1]
            return r0 + (r1 - r0) * (threshold - l0) / (l1 - l0)
    return best
