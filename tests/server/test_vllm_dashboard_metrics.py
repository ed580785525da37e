"""vLLM's Grafana dashboard reads a pagedserve server: every series it queries is exported with
the labels it filters and groups by, and the new per-request series count what happened.

DASHBOARD is data, copied from vLLM's published dashboard
examples/observability/prometheus_grafana/grafana.json (vllm-project/vllm, commit 4b5c627c):
the metric of every panel's `expr`, and the labels the expression uses beyond model_name (which
every query filters on, `{model_name="$model_name"}`, and the model_name template variable reads
with `label_values(model_name)`). Histograms appear under the sample the panel reads
(_bucket for quantiles and heatmaps, _sum/_count for averages).
"""
from __future__ import annotations

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

DASHBOARD: dict[str, tuple[str, ...]] = {
    "vllm:e2e_request_latency_seconds_bucket": ("le",),
    "vllm:e2e_request_latency_seconds_sum": (),
    "vllm:e2e_request_latency_seconds_count": (),
    "vllm:prompt_tokens_total": (),
    "vllm:generation_tokens_total": (),
    "vllm:time_per_output_token_seconds_bucket": ("le",),
    "vllm:time_per_output_token_seconds_sum": (),
    "vllm:time_per_output_token_seconds_count": (),
    "vllm:num_requests_running": (),
    "vllm:num_requests_waiting": (),
    "vllm:time_to_first_token_seconds_bucket": ("le",),
    "vllm:time_to_first_token_seconds_sum": (),
    "vllm:time_to_first_token_seconds_count": (),
    "vllm:kv_cache_usage_perc": (),
    "vllm:request_prompt_tokens_bucket": ("le",),
    "vllm:request_generation_tokens_bucket": ("le",),
    "vllm:request_success_total": ("finished_reason",),
    "vllm:request_queue_time_seconds_sum": (),
    "vllm:request_prefill_time_seconds_sum": (),
    "vllm:request_decode_time_seconds_sum": (),
    "vllm:request_max_num_generation_tokens_sum": (),
}
# Also asked for by #37, from vLLM's other dashboards and its metrics docs.
MORE = {
    "vllm:inter_token_latency_seconds_bucket": ("le",),
    "vllm:iteration_tokens_total_bucket": ("le",),
    "vllm:request_inference_time_seconds_sum": (),
    "vllm:cache_config_info": ("block_size", "num_gpu_blocks"),
}


def scrape(server) -> list:
    text = httpx.get(server.base_url + "/metrics", timeout=10).text
    return [s for f in text_string_to_metric_families(text) for s in f.samples]


def total(samples, name: str, **labels) -> float:
    return sum(s.value for s in samples if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))


@pytest.fixture(scope="module")
def before_after(server, http):
    before = scrape(server)
    body = {"model": server.model, "prompt": "the cat sat on", "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    assert http.post("/v1/completions", json=body).status_code == 200
    # 16 tokens, streamed: outputs that queue while the server's consumer is busy are sent together
    # (AsyncLLMEngine._catch_up), and on a loaded machine all 4 of a 4-token stream once came as
    # one chunk, leaving no gap between tokens to observe.
    with http.stream("POST", "/v1/completions", json=dict(body, stream=True, max_tokens=16)) as r:
        assert r.status_code == 200
        chunks = [line for line in r.iter_lines() if line.startswith("data: {")]
    assert len(chunks) >= 2
    return before, scrape(server)


@pytest.mark.parametrize("name, labels", sorted({**DASHBOARD, **MORE}.items()))
def test_series_the_dashboard_queries_is_exported_with_its_labels(before_after, server, name, labels):
    _, after = before_after
    found = [s for s in after if s.name == name]
    assert found, f"{name} is not exported"
    for s in found:
        assert s.labels.get("model_name") == server.model, s
        for label in labels:
            assert label in s.labels, (name, label, s.labels)


def test_every_vllm_series_carries_model_name(before_after, server):
    _, after = before_after
    vllm = [s for s in after if s.name.startswith("vllm:")]
    assert vllm and all(s.labels.get("model_name") == server.model for s in vllm)


def test_new_series_count_the_two_requests(before_after):
    before, after = before_after

    def d(name, **labels):
        return total(after, name, **labels) - total(before, name, **labels)
    # Both stopped at max_tokens.
    assert d("vllm:request_success_total", finished_reason="length") == 2
    assert d("vllm:request_prompt_tokens_count") == 2 and d("vllm:request_generation_tokens_sum") == 4 + 16
    assert d("vllm:request_max_num_generation_tokens_sum") == 4 + 16
    for phase in ("queue", "prefill", "decode", "inference"):
        assert d(f"vllm:request_{phase}_time_seconds_count") == 2, phase
        assert d(f"vllm:request_{phase}_time_seconds_sum") >= 0, phase
    # prefill + decode of a request is its inference time (same clock, same ends).
    assert d("vllm:request_prefill_time_seconds_sum") + d("vllm:request_decode_time_seconds_sum") \
        == pytest.approx(d("vllm:request_inference_time_seconds_sum"), abs=1e-6)
    # The streamed request's later tokens each arrived after another: at least one gap observed.
    assert d("vllm:inter_token_latency_seconds_count") >= 1
    # Every step ran at least one token; both prompts' prefill went through some step.
    assert d("vllm:iteration_tokens_total_count") >= 4
    assert d("vllm:iteration_tokens_total_sum") >= d("vllm:request_prompt_tokens_sum") + 3 + 15


def test_cache_config_info_names_the_kv_cache(before_after):
    _, after = before_after
    info = [s for s in after if s.name == "vllm:cache_config_info"]
    assert len(info) == 1 and info[0].value == 1.0
    assert info[0].labels["block_size"] == "16" and info[0].labels["num_gpu_blocks"] == "512"
    assert info[0].labels["enable_prefix_caching"] == "True"
