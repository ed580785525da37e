"""`pagedserve serve --data-parallel-size 2` (mp backend) on the demo model: routing
affinity and balance, metric aggregation, the openai client, and a replica killed under
load (last: it restarts a replica)."""
from __future__ import annotations

import asyncio
import json

import httpx

from dp_checks import (check_client_disconnect_aborts_on_the_replica, check_kill_under_load,
                       check_metrics_aggregate, check_openai_client, mp_replica_recovered)
from dp_helpers import (BLOCK_SIZE, arun_workload, replica_figures, run_workload,
                        shared_prefix_workload)

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

    before = [_metrics(mp_server.base_url)]
    run_workload(mp_server.base_url, shared_prefix_workload(seed=2), headers=mp_server.headers)
    prefix = replica_figures(before, [_metrics(mp_server.base_url)])

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
    check_metrics_aggregate(mp_server, mp_http)
    # the labelled values are each replica's own
    merged = mp_http.get("/metrics").text
    from dp_helpers import per_replica
    for i, url in enumerate(_replica_urls(mp_server)):
        own = per_replica(_metrics(url), "vllm:prefix_cache_queries_total")[""]
        assert per_replica(merged, "vllm:prefix_cache_queries_total")[str(i)] == own
    routed = per_replica(merged, "pagedserve:router_routed_requests_total")
    assert set(routed) == {"0", "1"}


def test_openai_client_against_the_dp_endpoint(mp_server):
    check_openai_client(mp_server, _replica_urls(mp_server)[1] + "/v1")


def test_client_disconnect_aborts_on_the_replica(mp_server):
    check_client_disconnect_aborts_on_the_replica(mp_server)


def test_killing_a_replica_under_load(mp_server):
    check_kill_under_load(mp_server, mp_replica_recovered)
