"""Routing policies: which replica a request goes to.

A policy sees the request's prefix hashes (prefix_key.py) and the live replicas' loads
(requests in flight, as the router counts them) and names one replica. Policies are plain
objects, shared by the mp pool and by the Ray request router, and tested on their own.
"""
from __future__ import annotations

import itertools
from collections import OrderedDict
from typing import Hashable, Mapping, Sequence

ROUTING_POLICIES = ("prefix", "round-robin")


class RoundRobinPolicy:
    """Replicas in turn, ignoring prefixes and load: the comparison baseline."""

    name = "round-robin"

    def __init__(self) -> None:
        self._counter = itertools.count()

    def choose(self, prefix_hashes: Sequence[bytes], loads: Mapping[Hashable, int]) -> Hashable:
        if not loads:
            raise ValueError("no live replica to route to")
        keys = sorted(loads, key=str)
        return keys[next(self._counter) % len(keys)]

    def forget(self, replica: Hashable) -> None:
        pass


class PrefixAffinityPolicy:
    """The replica that served the longest matching prefix, unless its queue is too long.

    Keeps a bounded LRU map block-hash -> replica of its own recent decisions; since block
    hashes are chained, the deepest hash found names the replica holding the longest prefix.

    Eligible replicas: those whose in-flight count exceeds the least-loaded one's by at most
    `imbalance_threshold`. The prefix holder is chosen if eligible; otherwise (and for
    prefixes never seen) the eligible replica that received the fewest requests so far, so
    prefix groups spread evenly over time rather than by momentary in-flight noise.
    """

    name = "prefix"

    def __init__(self, imbalance_threshold: int = 8, max_entries: int = 1 << 16) -> None:
        if imbalance_threshold < 0:
            raise ValueError(f"imbalance_threshold must be >= 0, got {imbalance_threshold}")
        if max_entries < 1:
            raise ValueError(f"max_entries must be >= 1, got {max_entries}")
        self.imbalance_threshold = imbalance_threshold
        self.max_entries = max_entries
        self._owner: OrderedDict[bytes, Hashable] = OrderedDict()
        self._routed: dict[Hashable, int] = {}

    def _affine(self, prefix_hashes: Sequence[bytes], loads: Mapping[Hashable, int]) -> Hashable | None:
        for h in reversed(prefix_hashes):
            owner = self._owner.get(h)
            if owner is not None and owner in loads:
                return owner
        return None

    def choose(self, prefix_hashes: Sequence[bytes], loads: Mapping[Hashable, int]) -> Hashable:
        if not loads:
            raise ValueError("no live replica to route to")
        lowest = min(loads.values())
        eligible = [r for r in loads if loads[r] <= lowest + self.imbalance_threshold]
        chosen = self._affine(prefix_hashes, loads)
        if chosen is None or chosen not in eligible:
            chosen = min(eligible, key=lambda r: (self._routed.get(r, 0), loads[r], str(r)))
        self._record(prefix_hashes, chosen)
        return chosen

    def _record(self, prefix_hashes: Sequence[bytes], replica: Hashable) -> None:
        self._routed[replica] = self._routed.get(replica, 0) + 1
        for h in prefix_hashes:
            self._owner[h] = replica
            self._owner.move_to_end(h)
        while len(self._owner) > self.max_entries:
            self._owner.popitem(last=False)

    def forget(self, replica: Hashable) -> None:
        """A replica restarted with an empty cache: its prefixes are owned by nobody."""
        for h in [h for h, r in self._owner.items() if r == replica]:
            del self._owner[h]


def make_policy(name: str, imbalance_threshold: int = 8) -> RoundRobinPolicy | PrefixAffinityPolicy:
    if name == "prefix":
        return PrefixAffinityPolicy(imbalance_threshold)
    if name == "round-robin":
        return RoundRobinPolicy()
    raise ValueError(f"routing_policy must be one of {ROUTING_POLICIES}, got {name!r}")
