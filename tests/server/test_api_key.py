"""--api-key: /v1 needs the bearer key; health and metrics stay open."""
from __future__ import annotations

import httpx
import openai
import pytest


def test_missing_or_wrong_key_is_401(server):
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": server.api_key},
                    {"Authorization": f"Basic {server.api_key}"}):
        r = httpx.get(server.v1 + "/models", headers=headers)
        assert r.status_code == 401, headers
        assert r.json()["error"]["code"] == "invalid_api_key"
        r = httpx.post(server.v1 + "/completions", headers=headers,
                       json={"model": server.model, "prompt": "hi", "max_tokens": 1})
        assert r.status_code == 401


def test_right_key_is_200(server):
    r = httpx.get(server.v1 + "/models", headers={"Authorization": f"Bearer {server.api_key}"})
    assert r.status_code == 200
    assert r.json()["data"][0]["id"] == server.model


def test_model_card_has_vllms_fields(server):
    """vLLM's card: root (the model as given to serve), parent (a LoRA's base: none), and one
    permission entry in OpenAI's older shape, which some clients read."""
    card = httpx.get(server.v1 + "/models", headers=server.headers).json()["data"][0]
    assert card["root"] == str(server.model_dir) and card["parent"] is None
    perm, = card["permission"]
    assert perm["object"] == "model_permission" and perm["id"].startswith("modelperm-")
    assert perm["allow_sampling"] and perm["allow_logprobs"] and not perm["allow_fine_tuning"]
    assert perm["organization"] == "*" and perm["group"] is None


def test_openai_client_with_wrong_key(server):
    bad = openai.OpenAI(base_url=server.v1, api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()


def test_health_and_metrics_stay_open(server):
    assert httpx.get(server.base_url + "/health").status_code == 200
    r = httpx.get(server.base_url + "/metrics")
    assert r.status_code == 200
    for name in ("num_requests_running", "num_requests_waiting", "num_requests_swapped",
                 "kv_cache_usage_perc", "prefix_cache_hit_rate", "num_preemptions_total",
                 "prompt_tokens_total", "generation_tokens_total",
                 "time_to_first_token_seconds_bucket", "time_per_output_token_seconds_bucket",
                 "e2e_request_latency_seconds_bucket"):
        assert f"pagedserve:{name}" in r.text, name
