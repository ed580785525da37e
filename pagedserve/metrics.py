"""Prometheus metrics of the server, and the KV-cache statistics they are read from.

Each app owns its own CollectorRegistry, so several servers (or tests) can live in one
process. Gauges that mirror engine state are read at scrape time from an EngineSnapshot,
which the engine thread refreshes after every engine call: the scrape never touches the
engine itself, so it cannot race a step running in the worker thread.

The core series are exported twice: as pagedserve:* and under vLLM's names (vllm:*), the
latter with vLLM's `model_name` label on every sample, so vLLM's Grafana dashboard reads a
pagedserve server unchanged (tests/server/test_vllm_dashboard_metrics.py holds the list it queries).
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
    iteration_tokens: int = 0       # tokens the step of this core iteration ran (0: no step)
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
    # Speculative decoding since start (spec_decode/stats.py), when speculative_config is set.
    spec_decode_enabled: bool = False
    spec_decode_num_drafts: int = 0
    spec_decode_num_draft_tokens: int = 0
    spec_decode_num_accepted_tokens: int = 0
    spec_decode_num_accepted_tokens_per_pos: list[int] = field(default_factory=list)
    spec_decode_proposer_seconds: float = 0.0
    spec_decode_num_paused_steps: int = 0
    spec_decode_num_unproposed_steps: int = 0
    spec_decode_num_shadow_probes: int = 0
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
        yield from spec_decode_families(PREFIX, s, {})

    def describe(self):
        return []


def spec_decode_families(prefix: str, s: EngineSnapshot, label: dict):
    """vLLM's spec_decode_* counters (the exposition adds _total), nothing without speculation."""
    if not s.spec_decode_enabled:
        return
    names, values = list(label), list(label.values())
    for name, doc, value in (
        ("spec_decode_num_drafts", "Number of spec decoding drafts (rows that verified proposals).",
         s.spec_decode_num_drafts),
        ("spec_decode_num_draft_tokens", "Number of draft tokens.", s.spec_decode_num_draft_tokens),
        ("spec_decode_num_accepted_tokens", "Number of accepted tokens.", s.spec_decode_num_accepted_tokens),
        ("spec_decode_proposer_seconds", "Host seconds spent proposing draft tokens.",
         s.spec_decode_proposer_seconds),
    ):
        c = CounterMetricFamily(prefix + name, doc, labels=names)
        c.add_metric(values, value)
        yield c
    c = CounterMetricFamily(prefix + "spec_decode_num_accepted_tokens_per_pos", "Accepted tokens per draft "
                            "position.", labels=names + ["position"])
    for pos, value in enumerate(s.spec_decode_num_accepted_tokens_per_pos):
        c.add_metric(values + [str(pos)], value)
    yield c
    if prefix == PREFIX:  # ours alone: vLLM has no such counters
        yield CounterMetricFamily(PREFIX + "spec_decode_paused_steps", "Steps in which speculation was paused "
                                  "for a low yield (spec_decode/policy.py).", value=s.spec_decode_num_paused_steps)
        yield CounterMetricFamily(PREFIX + "spec_decode_unproposed_steps", "Steps due to speculate that stayed "
                                  "overlapped: the host-side proposer had nothing to propose.",
                                  value=s.spec_decode_num_unproposed_steps)
        yield CounterMetricFamily(PREFIX + "spec_decode_shadow_probes", "Probes scored from the tokens decoding "
                                  "emitted instead of verified (spec_decode/shadow.py).",
                                  value=s.spec_decode_num_shadow_probes)


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
        # vLLM's model_name on every sample; a registry no app has named (a unit test's) goes without.
        label = {"model_name": m.model_name} if m.model_name else {}
        for name, doc, value in (
            ("num_requests_running", "Number of requests in model execution batches.", s.num_running),
            ("num_requests_waiting", "Number of requests waiting to be processed.", s.num_waiting),
            ("kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", s.kv_cache_usage),
        ):
            g = GaugeMetricFamily(VLLM_PREFIX + name, doc, labels=list(label))
            g.add_metric(list(label.values()), value)
            yield g
        for name, doc, value in (
            ("prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens.",
             s.prefix_cache_queries),
            ("prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.",
             s.prefix_cache_hits),
            ("num_preemptions", "Cumulative number of preemptions from the engine.", s.num_preemptions),
        ):
            c = CounterMetricFamily(VLLM_PREFIX + name, doc, labels=list(label))
            c.add_metric(list(label.values()), value)
            yield c
        if m.cache_config:
            info = dict(m.cache_config, **label)
            if s.cache_dtype:  # the KV pools' element type, once the core has reported it
                info["cache_dtype"] = s.cache_dtype
            g = GaugeMetricFamily(VLLM_PREFIX + "cache_config_info", "Information of the LLMEngine CacheConfig",
                                  labels=list(info))
            g.add_metric(list(info.values()), 1.0)
            yield g
        yield from spec_decode_families(VLLM_PREFIX, s, label)
        for source in m.vllm_named:
            for family in source.collect():
                yield _renamed(family, PREFIX, VLLM_PREFIX, label)

    def describe(self):
        return []


def _cache_config_info(prefix: str, s: EngineSnapshot) -> GaugeMetricFamily:
    """vLLM's cache_config_info: value 1, the KV cache's configuration in its labels."""
    info = GaugeMetricFamily(prefix + "cache_config_info", "Information of the KV cache configuration.",
                             labels=["cache_dtype", "num_gpu_blocks", "block_size"])
    info.add_metric([s.cache_dtype, str(s.num_gpu_blocks), str(s.block_size)], 1.0)
    return info


def _renamed(family: Metric, old_prefix: str, new_prefix: str, labels: dict[str, str]) -> Metric:
    """A copy of a collected family whose name and sample names swap old_prefix for new_prefix,
    every sample carrying `labels` too."""
    out = Metric(new_prefix + family.name[len(old_prefix):], family.documentation, family.type)
    out.samples = [s._replace(name=new_prefix + s.name[len(old_prefix):], labels={**s.labels, **labels})
                   for s in family.samples]
    return out


# Phases of a request (queue, prefill, decode, inference): vLLM's request-latency buckets.
_PHASE_BUCKETS = (0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0,
                  40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
# Tokens of a request (1-2-5 steps, as vLLM's) and of one engine step.
_TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000,
                  200000, 500000, 1000000)
_ITERATION_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768)


class ServerMetrics:
    """All metrics of one server; token counters and latencies are fed by the async engine.

    model_name: the served model name, vLLM's `model_name` label (the app sets it).
    cache_config: labels of vllm:cache_config_info (block size, block counts, ...), set once the
    engine core is ready; nothing is exported before.
    """

    def __init__(self, model_name: str = "") -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.snapshot = EngineSnapshot()
        self.model_name = model_name
        self.cache_config: dict[str, str] = {}
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
        # Per finished request, as vLLM's (engine/async_engine.py feeds them; phases on the core's clock).
        self.request_success = Counter(
            PREFIX + "request_success", "Finished requests (each of n completions), by finish reason.",
            ["finished_reason"], registry=r)
        self.request_prompt_tokens = Histogram(
            PREFIX + "request_prompt_tokens", "Prompt tokens of a finished request.", buckets=_TOKEN_BUCKETS, registry=r)
        self.request_generation_tokens = Histogram(
            PREFIX + "request_generation_tokens", "Generated tokens of a finished request (all its completions).",
            buckets=_TOKEN_BUCKETS, registry=r)
        self.request_max_num_generation_tokens = Histogram(
            PREFIX + "request_max_num_generation_tokens", "Tokens of a finished request's longest completion.",
            buckets=_TOKEN_BUCKETS, registry=r)
        self.request_queue_time = Histogram(
            PREFIX + "request_queue_time_seconds", "Arrival to first scheduled step.", buckets=_PHASE_BUCKETS, registry=r)
        self.request_prefill_time = Histogram(
            PREFIX + "request_prefill_time_seconds", "First scheduled step to first token.",
            buckets=_PHASE_BUCKETS, registry=r)
        self.request_decode_time = Histogram(
            PREFIX + "request_decode_time_seconds", "First token to finish.", buckets=_PHASE_BUCKETS, registry=r)
        self.request_inference_time = Histogram(
            PREFIX + "request_inference_time_seconds", "First scheduled step to finish.",
            buckets=_PHASE_BUCKETS, registry=r)
        self.inter_token_latency = Histogram(
            PREFIX + "inter_token_latency_seconds", "Time between successive outputs of a streamed request.",
            buckets=_TPOT_BUCKETS, registry=r)
        self.iteration_tokens = Histogram(
            PREFIX + "iteration_tokens_total", "Tokens per engine step.", buckets=_ITERATION_BUCKETS, registry=r)
        # Exported again as vllm:* (with model_name): the series vLLM's dashboards read.
        self.vllm_named = (self.prompt_tokens, self.generation_tokens, self.time_to_first_token,
                           self.time_per_output_token, self.e2e_request_latency, self.request_success,
                           self.request_prompt_tokens, self.request_generation_tokens,
                           self.request_max_num_generation_tokens, self.request_queue_time,
                           self.request_prefill_time, self.request_decode_time, self.request_inference_time,
                           self.inter_token_latency, self.iteration_tokens)

    def observe_snapshot(self, snapshot: EngineSnapshot) -> None:
        """A core iteration's snapshot: the gauges' new state, and its step's token count."""
        self.snapshot = snapshot
        if snapshot.iteration_tokens:
            self.iteration_tokens.observe(snapshot.iteration_tokens)

    def observe_finished(self, prompt_tokens: int, completion_tokens: list[int], finish_reasons: list,
                         engine_times: dict | None) -> None:
        """A finished request: its token histograms, finish reasons and, from the core's clock
        (arrival_time, first_scheduled_time, first_token_time, finished_time), its phases."""
        self.request_prompt_tokens.observe(prompt_tokens)
        self.request_generation_tokens.observe(sum(completion_tokens))
        self.request_max_num_generation_tokens.observe(max(completion_tokens, default=0))
        for reason in finish_reasons:
            self.request_success.labels(finished_reason=str(reason or "abort")).inc()
        t = engine_times or {}
        arrival, scheduled = t.get("arrival_time"), t.get("first_scheduled_time")
        first, done = t.get("first_token_time"), t.get("finished_time")
        if arrival is not None and scheduled is not None:
            self.request_queue_time.observe(max(0.0, scheduled - arrival))
        if scheduled is not None and first is not None:
            self.request_prefill_time.observe(max(0.0, first - scheduled))
        if first is not None and done is not None:
            self.request_decode_time.observe(max(0.0, done - first))
        if scheduled is not None and done is not None:
            self.request_inference_time.observe(max(0.0, done - scheduled))

    def render(self) -> bytes:
        return generate_latest(self.registry)
