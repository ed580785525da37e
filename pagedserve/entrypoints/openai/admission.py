"""Admission control: a bounded queue in front of the engine.

Without it every request is queued however many there are (20,000 at once all waited, and
the API process grew by 680 MB). Here an HTTP request is admitted while fewer than
max_num_seqs + max_waiting_requests are in the server (what can run in one batch, plus the
waiting queue), counted from admission, before tokenization, to the end of the response (so a
burst that arrives at once is counted as it arrives); beyond that it answers 503 with
`Retry-After` and counts in `pagedserve:rejected_requests_total{reason="queue_full"}`.

The default queue (`--max-waiting-requests` unset) is the KV cache's size in blocks (every
waiting request needs at least one block to start, so a longer queue could not be admitted
even if each were one block long), at most MAX_BATCHES_WAITING batches deep (a deeper queue
only adds latency: each batch takes about one request's lifetime to drain; and each waiting
request holds API-process memory, about 35 KB), never below max_num_seqs.
"""
from __future__ import annotations

from typing import Any, Callable

from prometheus_client import Counter

from pagedserve.entrypoints.openai.serving_common import APIError

RETRY_AFTER_S = 1
MAX_BATCHES_WAITING = 8


def default_max_waiting(num_gpu_blocks: int, max_num_seqs: int) -> int:
    return max(max_num_seqs, min(num_gpu_blocks, MAX_BATCHES_WAITING * max_num_seqs))


class Admission:
    def __init__(self, engine: Any, max_waiting_requests: int | None = None) -> None:
        blocks, _ = engine.kv_cache_shape
        max_num_seqs = engine.max_num_seqs
        if max_waiting_requests is None:
            max_waiting_requests = default_max_waiting(blocks, max_num_seqs)
        if max_waiting_requests < 0:
            raise ValueError(f"max_waiting_requests must be >= 0, got {max_waiting_requests}")
        self.engine = engine
        self.max_waiting_requests = max_waiting_requests
        self.limit = max_num_seqs + max_waiting_requests
        self.rejected = Counter("pagedserve:rejected_requests", "Requests answered 503 at admission.",
                                ["reason"], registry=engine.metrics.registry)
        self.rejected.labels("queue_full")
        self.in_flight = 0

    def admit(self) -> Callable[[], None]:
        """Count one request in, or raise a 503 (Retry-After); call the returned release() once
        its response has ended (idempotent)."""
        if self.in_flight >= self.limit:
            self.rejected.labels("queue_full").inc()
            raise APIError(f"the server is at capacity ({self.in_flight} requests running or waiting; the "
                           f"limit is max_num_seqs + --max-waiting-requests = {self.limit}); retry later",
                           503, type="server_error", code="server_overloaded",
                           headers={"Retry-After": str(RETRY_AFTER_S)})
        self.in_flight += 1
        done = False

        def release() -> None:
            nonlocal done
            if not done:
                done = True
                self.in_flight -= 1
        return release
