"""Clients that vanish mid-request get their requests aborted and their KV blocks freed."""
from __future__ import annotations

import time

import httpx

from server_process import MAX_MODEL_LEN

MAX_TOKENS = MAX_MODEL_LEN - 32
N = 6


def _wait_idle(server, timeout=60.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        m = server.metrics()
        if m["pagedserve:num_requests_running"] == 0 and m["pagedserve:kv_cache_usage_perc"] == 0 \
                and m["pagedserve:num_requests_waiting"] == 0:
            return m
        assert time.monotonic() < deadline, f"still busy after disconnect: {m}"
        time.sleep(0.1)


def test_streaming_disconnect_frees_blocks(server):
    before = _wait_idle(server)
    body = {"model": server.model, "prompt": "Disconnect me", "max_tokens": MAX_TOKENS,
            "temperature": 1.0, "stream": True, "ignore_eos": True}
    clients = [httpx.Client(base_url=server.base_url, headers=server.headers, timeout=60)
               for _ in range(N)]
    streams = []
    try:
        for cl in clients:
            cm = cl.stream("POST", "/v1/completions", json=body)
            r = cm.__enter__()
            assert r.status_code == 200
            lines = r.iter_lines()
            next(line for line in lines if line.startswith("data:"))  # generating now
            streams.append(cm)
        busy = server.metrics()
        assert busy["pagedserve:num_requests_running"] >= 1
        assert busy["pagedserve:kv_cache_usage_perc"] > 0
    finally:
        for cm in streams:
            cm.__exit__(None, None, None)
        for cl in clients:
            cl.close()
    after = _wait_idle(server)
    generated = after["pagedserve:generation_tokens_total"] - before["pagedserve:generation_tokens_total"]
    assert generated < N * MAX_TOKENS, "requests ran to the end instead of being aborted"


def test_non_streaming_disconnect_frees_blocks(server):
    before = _wait_idle(server)
    body = {"model": server.model, "prompt": "Wait for me", "max_tokens": MAX_TOKENS, "n": 8,
            "temperature": 1.0, "ignore_eos": True}
    with httpx.Client(base_url=server.base_url, headers=server.headers) as cl:
        try:
            cl.post("/v1/completions", json=body, timeout=httpx.Timeout(60, read=0.5))
            raise AssertionError("the request should still be running when the client gives up")
        except httpx.ReadTimeout:
            pass
    after = _wait_idle(server)
    generated = after["pagedserve:generation_tokens_total"] - before["pagedserve:generation_tokens_total"]
    assert generated < 8 * MAX_TOKENS, "request ran to the end instead of being aborted"
