"""PrefixAffinityRequestRouter inside Ray Serve's own routing machinery, without a cluster:
fake replicas, Ray's RequestRouter routing tasks and queue-length cache, no sends except
the cache bump that Ray's router makes after each routing (on_send_request)."""
from __future__ import annotations

import asyncio
from collections import Counter

import pytest

pytest.importorskip("ray.serve")

from ray.serve._private.common import (DeploymentHandleSource, DeploymentID,  # noqa: E402
                                       RequestMetadata)
from ray.serve.request_router import PendingRequest, ReplicaID  # noqa: E402

from pagedserve.serving.prefix_key import prefix_block_hashes  # noqa: E402
from pagedserve.serving.ray_router import PrefixAffinityRequestRouter  # noqa: E402

DEPLOYMENT = DeploymentID(name="EngineReplica", app_name="pagedserve")
THRESHOLD = 8


class FakeReplica:
    """What Ray's RequestRouter reads of a RunningReplica (an idle one)."""

    def __init__(self, name: str) -> None:
        self.replica_id = ReplicaID(name, DEPLOYMENT)
        self.max_ongoing_requests = 32
        self.is_cross_language = False
        self.node_id = ""
        self.availability_zone = None
        self.multiplexed_model_ids: set = set()

    async def get_queue_len(self, *, deadline_s: float) -> int:  # Ray probes new replicas
        return 0


async def _router(replicas):
    router = PrefixAffinityRequestRouter(deployment_id=DEPLOYMENT,
                                         handle_source=DeploymentHandleSource.REPLICA,
                                         use_replica_queue_len_cache=True)
    router.initialize_state(policy="prefix", imbalance_threshold=THRESHOLD)
    router.update_replicas(replicas)
    cache = router.replica_queue_len_cache
    while any(cache.get(r.replica_id) is None for r in replicas):
        await asyncio.sleep(0)  # Ray probes the new replicas: both idle
    return router


def _request(i: int) -> PendingRequest:
    """A new-prefix request as the front end sends it (check_kill_under_load's prompts)."""
    hashes = prefix_block_hashes([7 + i] * 24, 16)
    return PendingRequest(args=[{"prefix_hashes": [h.hex() for h in hashes]}], kwargs={},
                          metadata=RequestMetadata(request_id=str(i), internal_request_id=str(i)))


async def _route_burst(router, n: int) -> Counter:
    """n requests arriving together, routed by Ray's routing tasks; after each one is routed,
    what Ray's router does before sending it: bump the replica's cached queue length."""
    async def one(i: int):
        replica = await router._choose_replica_for_request(_request(i))
        router.on_send_request(replica.replica_id)
        return replica.replica_id.unique_id
    return Counter(await asyncio.gather(*(one(i) for i in range(n))))


def test_a_burst_of_new_prefixes_spreads_although_the_cache_has_not_caught_up():
    """Replica b trails a in requests routed so far (the policy's tie-break for new prefixes),
    so a burst of 16 new prefixes starts on b. Ray routes the whole burst before sending any
    of it, so its cache still says both are idle; the requests the router itself has just
    placed on b must count, so that b goes past the imbalance threshold and a gets the rest."""
    async def go():
        a, b = FakeReplica("a"), FakeReplica("b")
        router = await _router([a, b])
        router.policy._routed = {a.replica_id: 40, b.replica_id: 20}
        spread = await _route_burst(router, 16)
        cache = router.replica_queue_len_cache
        return spread, {r: cache.get(ReplicaID(r, DEPLOYMENT)) for r in "ab"}, dict(router._routing)

    spread, cached, still_routing = asyncio.run(go())
    assert sum(spread.values()) == 16
    assert spread["a"] >= 1 and spread["b"] >= 1, spread
    assert abs(spread["a"] - spread["b"]) <= THRESHOLD + 1, spread
    assert cached == dict(spread)  # after the sends, Ray's own cache has every request
    assert still_routing == {}  # and the router counts none of them a second time
