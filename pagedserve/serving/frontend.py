"""The DP front end: one OpenAI endpoint in front of a replica pool.

The front end tokenizes only to compute a request's routing key; validation, sampling
and streaming stay in the replicas, whose answers (errors included) pass through as they
are. /health is 200 {"status": "ok"} with every replica live, 200 {"status": "degraded"}
(header X-Pagedserve-Health: degraded) while some are down or restarting, and 503 with
none; /metrics merges every live replica's series under a `replica` label.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import logging
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST

from pagedserve.entrypoints.openai.api_server import APIKeyMiddleware, BodyLimitMiddleware, _error
from pagedserve.serving.metrics_merge import merge_replica_metrics
from pagedserve.serving.pool import NoReplicaAvailable, ReplicaFailed, ReplicaPool
from pagedserve.serving.prefix_key import prefix_block_hashes, request_token_ids

logger = logging.getLogger("pagedserve.dp")


async def merged_metrics(pool: ReplicaPool) -> str:
    """Every live replica's /metrics under a `replica` label, and the router's own series; a relay
    worker's pool (relay_worker.py) asks the front end that routes."""
    own = getattr(pool, "metrics_text", None)
    if own is not None:
        return await own()
    return merge_replica_metrics(await pool.metrics_texts(), pool.router_metrics())


def build_dp_app(pool: ReplicaPool, tokenizer: Any, block_size: int, api_key: str | None = None,
                 max_request_bytes: int = 1 << 20, manage_pool: bool = True,
                 after_start=None, before_stop=None) -> FastAPI:
    """manage_pool: start the pool with the app and stop it with the app. after_start /
    before_stop: async callables run once the pool is up / before it stops (relay workers)."""
    # Tokenizing a long prompt takes milliseconds: off the event loop, one at a time.
    tokenize = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="pagedserve-route")

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        if manage_pool:
            await pool.start()
        if after_start is not None:
            await after_start()
        try:
            yield
        finally:
            if before_stop is not None:
                await before_stop()
            if manage_pool:
                await pool.stop()
            tokenize.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(title="pagedserve (data parallel)", lifespan=lifespan)
    app.state.pool = pool

    def routing_key(path: str, body: bytes) -> list[bytes]:
        return prefix_block_hashes(request_token_ids(tokenizer, path, body), block_size)

    @app.get("/health")
    async def health() -> Response:
        h = await pool.health()
        if h["status"] == "down":
            return JSONResponse(h, status_code=503)
        return JSONResponse(h, headers={"X-Pagedserve-Health": h["status"]})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(await merged_metrics(pool), media_type=CONTENT_TYPE_LATEST)

    @app.api_route("/v1/{rest:path}", methods=["GET", "POST"])
    async def forward(rest: str, request: Request) -> Response:
        path = "/v1/" + rest
        body = await request.body()
        hashes: list[bytes] = []
        if request.method == "POST" and body:
            loop = asyncio.get_running_loop()
            hashes = await loop.run_in_executor(tokenize, routing_key, path, body)
        try:
            resp = await pool.forward(request.method, path, body, hashes)
        except NoReplicaAvailable as e:
            return _error(503, str(e), type="server_error", code="no_replica_available")
        except ReplicaFailed as e:
            return _error(503, str(e), type="server_error", code="replica_failed")
        if resp.content_type.startswith("text/event-stream"):
            return StreamingResponse(resp.chunks, status_code=resp.status,
                                     media_type=resp.content_type,
                                     headers={"Cache-Control": "no-cache"})
        data = b"".join([c async for c in resp.chunks])
        return Response(data, status_code=resp.status, media_type=resp.content_type)

    app.add_middleware(BodyLimitMiddleware, max_bytes=max_request_bytes)
    if api_key:
        app.add_middleware(APIKeyMiddleware, api_key=api_key)
    return app
