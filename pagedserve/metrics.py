"""Prometheus metrics of the server, and the KV-cache statistics they are read from.

Each app owns its own CollectorRegistry, so several servers (or tests) can live in one
process. Gauges that mirror engine state are read at scrape time from an EngineSnapshot,
which the engine thread refreshes after every engine call: the scrape never touches the
engine itself, so it cannot race a step running in the worker thread.

The core series are exported twice: as pagedserve:* and under vLLM's names (vllm:*).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import prometheus_client
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric

from pagedserve.core.stats import KVCacheStats

__all__ = ["KVCacheStats", "EngineSnapshot", "ServerMetrics"]

PREFIX = "pagedserve:"
prometheus_client.disable_created_metrics()  # *_created series only add noise to scrapes

# Buckets in seconds; CPU tests and H200 runs both land inside these ranges.
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05,
                 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
_E2E_BUCKETS = (0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
                50.0, 60.0, 120.0, 240.0, 480.0)
# Grammar compile time (structured outputs), seconds: a small schema (~1 ms) to a pathological one.
COMPILE_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
                   30.0, 60.0)


@dataclass
class EngineSnapshot:
    """Engine state at the end of the latest engine call (step, add or abort)."""
    num_running: int = 0
    num_waiting: int = 0
    num_swapped: int = 0
    kv_cache_usage: float = 0.0
    prefix_cache_hit_rate: float = 0.0
    num_preemptions: int = 0
    prefix_cache_queries: int = 0   # prompt tokens looked up in the prefix cache, since start
    prefix_cache_hits: int = 0      # of those, tokens found cached
    # Structured outputs (engine/structured/compiler.py), since start: grammars compiled, requests
    # served from the compile cache, and compile seconds (sum, and counts per COMPILE_BUCKETS
    # bucket, not cumulative, the last one above the largest bound).
    structured_output_compiles: int = 0
    structured_output_cache_hits: int = 0
    structured_output_compile_seconds_sum: float = 0.0
    structured_output_compile_seconds_buckets: list[int] = field(default_factory=list)
    cache_dtype: str = ""           # the KV pools' element type (fp8_e4m3, bfloat16, ...)
    num_gpu_blocks: int = 0
    block_size: int = 0


class _SnapshotCollector:
    """Turns the latest EngineSnapshot into gauges (and the preemption counter) at scrape time."""

    def __init__(self, metrics: "ServerMetrics") -> None:
        self._metrics = metrics

    def collect(self):
        s = self._metrics.snapshot
        for name, doc, value in (
            ("num_requests_running", "Requests in the running batch.", s.num_running),
            ("num_requests_waiting", "Requests waiting to be scheduled.", s.num_waiting),
            ("num_requests_swapped", "Requests swapped out to CPU memory.", s.num_swapped),
            ("kv_cache_usage_perc", "Fraction of KV-cache blocks in use (0..1).", s.kv_cache_usage),
            ("prefix_cache_hit_rate", "Prefix-cache hits over queries, in tokens (0..1).",
             s.prefix_cache_hit_rate),
        ):
            yield GaugeMetricFamily(PREFIX + name, doc, value=value)
        yield CounterMetricFamily(PREFIX + "num_preemptions", "Preemptions since start.",
                                  value=s.num_preemptions)
        yield CounterMetricFamily(PREFIX + "structured_output_compiles", "Grammars compiled for "
                                  "structured outputs (cache misses).", value=s.structured_output_compiles)
        yield CounterMetricFamily(PREFIX + "structured_output_cache_hits", "Structured-output requests "
                                  "whose grammar came from the compile cache.",
                                  value=s.structured_output_cache_hits)
        counts = s.structured_output_compile_seconds_buckets or [0] * (len(COMPILE_BUCKETS) + 1)
        cumulative, running = [], 0
        for bound, c in zip([*map(str, COMPILE_BUCKETS), "+Inf"], counts):
            running += c
            cumulative.append((bound, running))
        yield HistogramMetricFamily(PREFIX + "structured_output_compile_seconds", "Time to compile one "
                                    "structured-output grammar.", buckets=cumulative,
                                    sum_value=s.structured_output_compile_seconds_sum)
        yield _cache_config_info(PREFIX, s)

    def describe(self):
        return []


VLLM_PREFIX = "vllm:"


class _VllmNamesCollector:
    """The core series again under vLLM's names, so routers and dashboards built for vLLM
    (production-stack router, llm-d scheduler, Grafana boards) read pagedserve unchanged.

    Same values as the pagedserve:* series, read at scrape time; nothing is counted twice.
    """

    def __init__(self, metrics: "ServerMetrics") -> None:
        self._metrics = metrics

    def collect(self):
        m, s = self._metrics, self._metrics.snapshot
        for name, doc, value in (
            ("num_requests_running", "Number of requests in model execution batches.", s.num_running),
            ("num_requests_waiting", "Number of requests waiting to be processed.", s.num_waiting),
            ("kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", s.kv_cache_usage),
        ):
            yield GaugeMetricFamily(VLLM_PREFIX + name, doc, value=value)
        for name, doc, value in (
            ("prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens.",
             s.prefix_cache_queries),
            ("prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.",
             s.prefix_cache_hits),
            ("num_preemptions", "Cumulative number of preemptions from the engine.", s.num_preemptions),
        ):
            yield CounterMetricFamily(VLLM_PREFIX + name, doc, value=value)
        yield _cache_config_info(VLLM_PREFIX, s)
        for source, name in ((m.prompt_tokens, "prompt_tokens"),
                             (m.generation_tokens, "generation_tokens"),
                             (m.time_to_first_token, "time_to_first_token_seconds"),
                             (m.time_per_output_token, "time_per_output_token_seconds"),
                             (m.e2e_request_latency, "e2e_request_latency_seconds")):
            for family in source.collect():
                yield _renamed(family, PREFIX, VLLM_PREFIX)

    def describe(self):
        return []


def _cache_config_info(prefix: str, s: EngineSnapshot) -> GaugeMetricFamily:
    """vLLM's cache_config_info: value 1, the KV cache's configuration in its labels."""
    info = GaugeMetricFamily(prefix + "cache_config_info", "Information of the KV cache configuration.",
                             labels=["cache_dtype", "num_gpu_blocks", "block_size"])
    info.add_metric([s.cache_dtype, str(s.num_gpu_blocks), str(s.block_size)], 1.0)
    return info


def _renamed(family: Metric, old_prefix: str, new_prefix: str) -> Metric:
    """A copy of a collected family whose name and sample names swap old_prefix for new_prefix."""
    out = Metric(new_prefix + family.name[len(old_prefix):], family.documentation, family.type)
    out.samples = [s._replace(name=new_prefix + s.name[len(old_prefix):]) for s in family.samples]
    return out


class ServerMetrics:
    """All metrics of one server; token counters and latencies are fed by the async engine."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.snapshot = EngineSnapshot()
        self.registry.register(_SnapshotCollector(self))
        self.registry.register(_VllmNamesCollector(self))
        r = self.registry
        self.prompt_tokens = Counter(PREFIX + "prompt_tokens", "Prefilled prompt tokens.", registry=r)
        self.generation_tokens = Counter(PREFIX + "generation_tokens", "Generated tokens.", registry=r)
        self.time_to_first_token = Histogram(
            PREFIX + "time_to_first_token_seconds", "Arrival to first generated token.",
            buckets=_TTFT_BUCKETS, registry=r)
        self.time_per_output_token = Histogram(
            PREFIX + "time_per_output_token_seconds", "Mean time between output tokens of a request.",
            buckets=_TPOT_BUCKETS, registry=r)
        self.e2e_request_latency = Histogram(
            PREFIX + "e2e_request_latency_seconds", "Arrival to finish of a request.",
            buckets=_E2E_BUCKETS, registry=r)

    def render(self) -> bytes:
        return generate_latest(self.registry)
