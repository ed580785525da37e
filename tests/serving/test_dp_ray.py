"""`pagedserve serve --data-parallel-size 2 --data-parallel-backend ray` on a local Ray
cluster with 2 demo-model replicas: the mp tests' checks, with Ray doing placement,
routing (our PrefixAffinityRequestRouter), health checks and restarts."""
from __future__ import annotations

import json

import httpx
import pytest

pytest.importorskip("ray.serve")

from dp_checks import (check_client_disconnect_aborts_on_the_replica, check_kill_under_load,
                       check_metrics_aggregate, check_openai_client)  # noqa: E402
from dp_helpers import replica_figures, run_workload, shared_prefix_workload  # noqa: E402


def _metrics(url: str) -> str:
    return httpx.get(url + "/metrics", timeout=10).text


@pytest.fixture(scope="module")
def ray_http(ray_server):
    with httpx.Client(base_url=ray_server.base_url, headers=ray_server.headers, timeout=120) as c:
        yield c


class TestAgainstOneReplica:
    """The checks whose reference is one replica alone: it runs for these two tests only (launched
    before ray_server, so that both start together: single_server_launched comes first)."""

    def test_ray_prefix_routing_keeps_one_replicas_hit_rate_and_balances(self, single_server_launched, ray_server,
                                                                         single_server):
        before = [_metrics(single_server.base_url)]
        run_workload(single_server.base_url, shared_prefix_workload(seed=11))
        single = replica_figures(before, [_metrics(single_server.base_url)])

        def read():
            return [_metrics(ray_server.base_url)]
        before = read()
        run_workload(ray_server.base_url, shared_prefix_workload(seed=12), headers=ray_server.headers)
        import time
        time.sleep(1.5)  # the replicas report their metrics every half second
        prefix = replica_figures(before, read())
        print("\nDP routing figures (ray):", json.dumps({"one_replica": single, "dp2_prefix": prefix}))
        assert single["requests"] == prefix["requests"] == 48
        assert single["hit_rate"] > 0.5
        assert abs(prefix["hit_rate"] - single["hit_rate"]) <= 0.05
        assert len(prefix["shares"]) == 2 and min(prefix["shares"].values()) >= 0.30

    def test_ray_openai_client_against_the_dp_endpoint(self, single_server_launched, ray_server, single_server):
        check_openai_client(ray_server, single_server.v1)


def test_ray_metrics_aggregate_every_replica_with_a_label(ray_server, ray_http):
    check_metrics_aggregate(ray_server, ray_http)


def test_ray_client_disconnect_aborts_on_the_replica(ray_server):
    check_client_disconnect_aborts_on_the_replica(ray_server)


def test_ray_killing_a_replica_under_load(ray_server):
    def recovered(health, victim):
        pids = {r["pid"] for r in health["replicas"]}
        return len(pids) == 2 and victim["pid"] not in pids
    check_kill_under_load(ray_server, recovered)
