"""`pagedserve serve --data-parallel-size 2` (mp backend) on the demo model: routing
affinity and balance, metric aggregation, the openai client, and a replica killed under load.
The kill test runs last: it restarts a replica."""
from __future__ import annotations

import asyncio
import json
import os
import signal
import threading
import time

import httpx
import pytest

from dp_helpers import (BLOCK_SIZE, MODEL, arun_workload, per_replica, replica_figures,
                        run_workload, shared_prefix_workload)

from pagedserve.serving.frontend import build_dp_app
from pagedserve.serving.mp_pool import ProcessReplicaPool
from pagedserve.serving.routing import RoundRobinPolicy


def _replica_urls(server) -> list[str]:
    return [r["url"] for r in server.health()[1]["replicas"]]


def _metrics(url: str) -> str:
    return httpx.get(url + "/metrics", timeout=10).text


def _round_robin_run(urls: list[str], prompts: list[list[int]]) -> None:
    """The same front end over the same replicas, with the round-robin policy."""
    from transformers import AutoTokenizer

    from pagedserve.demo_model import DEMO_MODEL_DIR

    async def go():
        pool = ProcessReplicaPool.attach(urls, RoundRobinPolicy())
        await pool.start()
        app = build_dp_app(pool, AutoTokenizer.from_pretrained(str(DEMO_MODEL_DIR)), BLOCK_SIZE,
                           manage_pool=False)
        try:
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://dp",
                                         timeout=120) as c:
                await arun_workload(c, prompts)
        finally:
            await pool.stop()
    asyncio.run(go())


def test_prefix_routing_keeps_one_replicas_hit_rate_and_balances(mp_server):
    urls = _replica_urls(mp_server)

    # One replica alone (the baseline), then DP=2 with prefix routing, then round-robin;
    # each run has its own prefixes, so no run finds another's blocks cached.
    before = [_metrics(urls[0])]
    run_workload(urls[0], shared_prefix_workload(seed=1))
    single = replica_figures(before, [_metrics(urls[0])])

    before = [mp_server.health() and httpx.get(mp_server.base_url + "/metrics").text]
    run_workload(mp_server.base_url, shared_prefix_workload(seed=2), headers=mp_server.headers)
    prefix = replica_figures(before, [httpx.get(mp_server.base_url + "/metrics").text])

    before = [_metrics(u) for u in urls]
    _round_robin_run(urls, shared_prefix_workload(seed=3))
    rr = replica_figures(before, [_metrics(u) for u in urls])

    print("\nDP routing figures (mp):", json.dumps(
        {"one_replica": single, "dp2_prefix": prefix, "dp2_round_robin": rr}))
    assert single["requests"] == prefix["requests"] == rr["requests"] == 48
    assert single["hit_rate"] > 0.5  # the workload does share prefixes
    assert abs(prefix["hit_rate"] - single["hit_rate"]) <= 0.05
    assert len(prefix["shares"]) == 2 and min(prefix["shares"].values()) >= 0.30


def test_metrics_aggregate_every_replica_with_a_label(mp_server, mp_http):
    urls = _replica_urls(mp_server)
    r = mp_http.post("/v1/completions", json={"model": MODEL, "prompt": list(range(5, 40)),
                                              "max_tokens": 5, "ignore_eos": True})
    assert r.status_code == 200, r.text
    merged = mp_http.get("/metrics").text
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting",
                 "vllm:kv_cache_usage_perc", "vllm:prefix_cache_queries_total",
                 "vllm:prefix_cache_hits_total", "vllm:time_to_first_token_seconds_count",
                 "vllm:time_per_output_token_seconds_sum", "pagedserve:generation_tokens_total"):
        by_replica = per_replica(merged, name)
        assert set(by_replica) == {"0", "1"}, name
        for i, url in enumerate(urls):  # the labelled value is that replica's own
            own = per_replica(_metrics(url), name)[""]
            if name.startswith("vllm:num_requests") or "usage" in name:
                continue  # gauges may move between the two reads
            assert by_replica[str(i)] == own, (name, i)
    routed = per_replica(merged, "pagedserve:router_routed_requests_total")
    assert set(routed) == {"0", "1"} and sum(routed.values()) >= 1


def test_openai_client_against_the_dp_endpoint(mp_server):
    import openai
    urls = _replica_urls(mp_server)
    client = openai.OpenAI(base_url=mp_server.v1, api_key="sk-dp-test", max_retries=0, timeout=120)
    direct = openai.OpenAI(base_url=urls[1] + "/v1", api_key="unused", max_retries=0, timeout=120)
    assert [m.id for m in client.models.list().data] == [MODEL]

    kw = dict(model=MODEL, prompt="In the beginning God created", max_tokens=12, temperature=0)
    got = client.completions.create(**kw)
    ref = direct.completions.create(**kw)  # greedy: any replica gives the same text
    assert got.choices[0].text == ref.choices[0].text and got.usage.completion_tokens == 12

    msgs = [{"role": "user", "content": "Continue: The LORD is my shepherd"}]
    chat = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=10, temperature=0)
    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model=MODEL, messages=msgs, max_tokens=10, temperature=0, stream=True) if c.choices)
    assert chat.choices[0].message.content == streamed != ""

    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=mp_server.v1, api_key="wrong", max_retries=0).models.list()
    with pytest.raises(openai.BadRequestError) as e:  # the replica's own validation, passed through
        client.completions.create(model=MODEL, prompt="x", max_tokens=-1)
    assert "max_tokens" in str(e.value)


def _wait(pred, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = pred()
        if got:
            return got
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def test_killing_a_replica_under_load(mp_server):
    """In flight on the dead replica: a clean 503 / SSE error; everything else is served;
    /health is degraded until the supervisor has restarted the replica."""
    victim = "1"
    results: list[tuple[str, object]] = []

    def one(i: int) -> None:
        body = {"model": MODEL, "prompt": [7 + i] * 40, "max_tokens": 150, "ignore_eos": True,
                "temperature": 0, "stream": i % 2 == 0}
        with httpx.Client(base_url=mp_server.base_url, headers=mp_server.headers, timeout=120) as c:
            if not body["stream"]:
                r = c.post("/v1/completions", json=body)
                results.append(("json", (r.status_code, r.json())))
                return
            with c.stream("POST", "/v1/completions", json=body) as r:
                if r.status_code != 200:  # failed before the replica's first event
                    r.read()
                    results.append(("json", (r.status_code, r.json())))
                    return
                events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
                results.append(("sse", (r.status_code, events)))

    threads = [threading.Thread(target=one, args=(i,)) for i in range(12)]
    for t in threads:
        t.start()
    replicas = _wait(lambda: (lambda h: h["replicas"] if all(
        r["in_flight"] >= 2 for r in h["replicas"]) else None)(mp_server.health()[1]),
        60, "requests in flight on both replicas")
    os.kill(replicas[int(victim)]["pid"], signal.SIGKILL)

    # Degraded, yet new requests are all served (by the survivor) meanwhile.
    _wait(lambda: mp_server.health()[1]["status"] == "degraded", 10, "degraded /health")
    code, h = mp_server.health()
    assert code == 200 and h["live_replicas"] == 1
    with httpx.Client(base_url=mp_server.base_url, headers=mp_server.headers, timeout=120) as c:
        for i in range(4):
            r = c.post("/v1/completions", json={"model": MODEL, "prompt": [300 + i] * 20,
                                                "max_tokens": 3})
            assert r.status_code == 200, r.text
    for t in threads:
        t.join(timeout=120)
        assert not t.is_alive(), "a request hung"

    ok = failed = 0
    for kind, (status, payload) in results:
        if kind == "json":
            if status == 200:
                ok += payload["usage"]["completion_tokens"] == 150
            else:
                assert status == 503 and payload["error"]["code"] == "replica_failed", payload
                failed += 1
        else:
            if payload[-1] == "[DONE]" and "error" in payload[-2]:
                assert json.loads(payload[-2])["error"]["code"] == "replica_failed"
                failed += 1
            else:
                assert payload[-1] == "[DONE]"
                ok += json.loads(payload[-2])["choices"][0]["finish_reason"] == "length"
    assert ok + failed == 12 and ok >= 2 and failed >= 2, (ok, failed)

    # Back: the supervisor restarted it and /health is ok again.
    _wait(lambda: mp_server.health()[1]["status"] == "ok", 180, "the replica's restart")
    h = mp_server.health()[1]
    assert h["replicas"][int(victim)]["restarts"] == 1
    assert httpx.get(h["replicas"][int(victim)]["url"] + "/health").status_code == 200
