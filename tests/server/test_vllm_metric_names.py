"""The core series are also exported under vLLM's names, with the same values."""
from __future__ import annotations

V = "vllm:"


def test_vllm_names_follow_a_request_and_prefix_hits(server, http):
    prompt = list(range(200, 200 + 64))  # four full blocks of 16
    body = {"model": server.model, "prompt": prompt, "max_tokens": 3, "temperature": 0,
            "ignore_eos": True}
    before = server.metrics()
    assert http.post("/v1/completions", json=body).status_code == 200
    assert http.post("/v1/completions", json=body).status_code == 200
    after = server.metrics()

    def d(name):
        return after[name] - before[name]

    # The second request finds its first 63 prompt tokens cached (the last one is recomputed).
    assert d(V + "prefix_cache_queries_total") >= 2 * len(prompt) - 1
    assert d(V + "prefix_cache_hits_total") >= 48
    assert after[V + "prefix_cache_hits_total"] / after[V + "prefix_cache_queries_total"] \
        == after["pagedserve:prefix_cache_hit_rate"]
    for name in ("prompt_tokens_total", "generation_tokens_total",
                 "time_to_first_token_seconds_count", "time_to_first_token_seconds_sum",
                 "time_per_output_token_seconds_count", "e2e_request_latency_seconds_count"):
        assert after[V + name] == after["pagedserve:" + name], name
    assert d(V + "time_to_first_token_seconds_count") == 2
    assert d(V + "generation_tokens_total") == 6
    for gauge in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc"):
        assert after[V + gauge] == after["pagedserve:" + gauge], gauge
