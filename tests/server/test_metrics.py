"""/metrics counts what the server did: tokens, latencies, prefix-cache hits."""
from __future__ import annotations

P = "pagedserve:"


def _delta(after, before, name):
    return after[P + name] - before[P + name]


def test_token_counters_and_histograms_follow_a_request(server, http):
    before = server.metrics()
    r = http.post("/v1/completions", json={"model": server.model, "prompt": "count me please",
                                           "max_tokens": 7, "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200, r.text
    usage = r.json()["usage"]
    after = server.metrics()
    assert _delta(after, before, "prompt_tokens_total") == usage["prompt_tokens"]
    assert _delta(after, before, "generation_tokens_total") == usage["completion_tokens"] == 7
    for h in ("time_to_first_token_seconds", "time_per_output_token_seconds",
              "e2e_request_latency_seconds"):
        assert _delta(after, before, h + "_count") == 1, h
        assert _delta(after, before, h + "_sum") > 0, h
    # the whole request takes longer than its first token
    assert _delta(after, before, "e2e_request_latency_seconds_sum") >= \
        _delta(after, before, "time_to_first_token_seconds_sum")


def test_prefix_cache_hit_rate_rises_on_a_repeated_prompt(server, http):
    prompt = list(range(3, 3 + 80))  # five full blocks of 16
    body = {"model": server.model, "prompt": prompt, "max_tokens": 2, "temperature": 0}
    assert http.post("/v1/completions", json=body).status_code == 200
    first = server.metrics()[P + "prefix_cache_hit_rate"]
    assert http.post("/v1/completions", json=body).status_code == 200
    second = server.metrics()[P + "prefix_cache_hit_rate"]
    assert 0 < second <= 1
    assert second > first
