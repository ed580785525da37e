"""One /metrics for N replicas: every replica's series with a `replica` label added.

Families keep their names (pagedserve:* and vllm:*), so a dashboard that sums over
replicas reads the DP endpoint like one big server and can still split by replica.
"""
from __future__ import annotations

from typing import Iterable, Mapping

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import Metric
from prometheus_client.parser import text_string_to_metric_families


class _Families:
    def __init__(self, families: list[Metric]) -> None:
        self._families = families

    def collect(self):
        return iter(self._families)

    def describe(self):
        return []


def merge_replica_metrics(texts: Mapping[str, str], extra: Iterable[Metric] = ()) -> bytes:
    """texts: replica label -> that replica's exposition text; extra: the router's own families."""
    merged: dict[str, Metric] = {}
    for replica, text in texts.items():
        for family in text_string_to_metric_families(text):
            out = merged.get(family.name)
            if out is None:
                out = merged[family.name] = Metric(family.name, family.documentation, family.type)
            out.samples.extend(s._replace(labels={**s.labels, "replica": replica})
                               for s in family.samples)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Families(list(merged.values()) + list(extra)))
    return generate_latest(registry)
