"""The prefix-aware policy as a Ray Serve request router (ray backend).

Ray Serve calls choose_replicas for each request sent through a DeploymentHandle; we rank
the policy's choice first and every other replica second, and Ray then does the rest:
queue-length probing, backoff when the chosen replica is full, retries on a replica that
died before the request reached it. Loads are Ray's own cached queue lengths.

The request's routing key travels as args[0]["prefix_hashes"] (hex strings), put there by
the front end (ray_pool.py).
"""
from __future__ import annotations

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

    async def choose_replicas(self, candidate_replicas: List[RunningReplica],
                              pending_request: Optional[PendingRequest] = None
                              ) -> List[List[RunningReplica]]:
        if not candidate_replicas:
            return []
        by_id = {r.replica_id: r for r in candidate_replicas}
        cache = self.replica_queue_len_cache
        loads = {rid: cache.get(rid) or 0 for rid in by_id}
        chosen = self.policy.choose(_prefix_hashes(pending_request), loads)
        return [[by_id[chosen]], [r for rid, r in by_id.items() if rid != chosen]]

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self.policy.forget(replica_id)
