"""What the DP front end needs from a set of replicas, whatever runs them."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import AsyncIterator, Protocol, Sequence

from prometheus_client.core import Metric


class NoReplicaAvailable(RuntimeError):
    """No replica is live: answered 503, the client may retry later."""


class ReplicaFailed(RuntimeError):
    """The replica serving this request died before it answered, and it could not be sent
    elsewhere: answered 503."""


@dataclass
class ReplicaResponse:
    """A replica's answer. For event streams, chunks end with an SSE error event and [DONE]
    if the replica dies mid-stream; other bodies arrive whole (one chunk) or not at all."""
    status: int
    content_type: str
    chunks: AsyncIterator[bytes]
    headers: dict[str, str] = field(default_factory=dict)  # passed on to the client (Retry-After)


class ReplicaPool(Protocol):
    backend: str

    async def start(self) -> None: ...

    async def stop(self) -> None: ...

    async def forward(self, method: str, path: str, body: bytes,
                      prefix_hashes: Sequence[bytes]) -> ReplicaResponse:
        """Route and send one request. Raises NoReplicaAvailable or ReplicaFailed."""

    async def health(self) -> dict:
        """{"status": "ok" | "degraded" | "down", "replicas": [...per-replica facts...]}"""

    async def metrics_texts(self) -> dict[str, str]:
        """replica label -> that replica's /metrics text, for the live replicas."""

    def router_metrics(self) -> list[Metric]:
        """The pool's own families (routing decisions, in-flight counts, replica health)."""


async def one_chunk(data: bytes) -> AsyncIterator[bytes]:
    yield data
