"""The prefix-aware policy as a Ray Serve request router (ray backend).

Ray Serve calls choose_replicas for each request sent through a DeploymentHandle; we rank
the policy's choice first and every other replica second, and Ray then does the rest:
queue-length probing, backoff when the chosen replica is full, retries on a replica that
died before the request reached it. Loads are Ray's own cached queue lengths plus the
requests this router has ranked a replica first for and Ray has not finished routing yet.

The request's routing key travels as args[0]["prefix_hashes"] (hex strings), put there by
the front end (ray_pool.py).
"""
from __future__ import annotations

import asyncio
from collections import Counter
from typing import List, Optional

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from pagedserve.serving.routing import make_policy


def _prefix_hashes(pending_request: Optional[PendingRequest]) -> list[bytes]:
    if pending_request is None or not pending_request.args:
        return []
    arg = pending_request.args[0]
    if not isinstance(arg, dict):
        return []
    return [bytes.fromhex(h) for h in arg.get("prefix_hashes", ())]


class PrefixAffinityRequestRouter(RequestRouter):
    """request_router_kwargs: policy ("prefix" | "round-robin"), imbalance_threshold."""

    def initialize_state(self, policy: str = "prefix", imbalance_threshold: int = 8, **kwargs) -> None:
        self.policy = make_policy(policy, imbalance_threshold)
        # Requests whose routing is still in progress -> the replica we ranked first for them.
        # Ray's cache counts a request only once it is sent (on_send_request), and Ray routes
        # all the requests queued at one moment before sending any of them; without these a
        # burst would see the same loads throughout and could all land on one replica, past
        # the imbalance threshold.
        self._routing: dict[asyncio.Future, ReplicaID] = {}
        self._routing_per_replica: Counter[ReplicaID] = Counter()

    async def choose_replicas(self, candidate_replicas: List[RunningReplica],
                              pending_request: Optional[PendingRequest] = None
                              ) -> List[List[RunningReplica]]:
        if not candidate_replicas:
            return []
        by_id = {r.replica_id: r for r in candidate_replicas}
        cache = self.replica_queue_len_cache
        loads = {rid: (cache.get(rid) or 0) + self._routing_per_replica[rid] for rid in by_id}
        chosen = self.policy.choose(_prefix_hashes(pending_request), loads)
        if pending_request is not None:
            self._count_while_routing(pending_request.future, chosen)
        return [[by_id[chosen]], [r for rid, r in by_id.items() if rid != chosen]]

    def _count_while_routing(self, future: asyncio.Future, replica_id: ReplicaID) -> None:
        """Count the request on replica_id until Ray has routed it (its future is done; Ray
        then sends it and its cache counts it). Asked again for the same request (Ray's
        backoff), the count moves to the new choice."""
        if future.done():
            return
        previous = self._routing.get(future)
        if previous is None:
            future.add_done_callback(self._routing_done)
        else:
            self._routing_per_replica[previous] -= 1
        self._routing[future] = replica_id
        self._routing_per_replica[replica_id] += 1

    def _routing_done(self, future: asyncio.Future) -> None:
        replica_id = self._routing.pop(future)
        self._routing_per_replica[replica_id] -= 1
        if self._routing_per_replica[replica_id] <= 0:
            del self._routing_per_replica[replica_id]

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self.policy.forget(replica_id)
