"""The DP front end: one OpenAI endpoint in front of a replica pool.

The front end validates a request body's schema (the replica's own request models: a bad body
is a 400 here, before routing) and tokenizes it only to compute its routing key; the
cross-field checks, sampling and streaming stay in the replicas, whose answers (errors
included) pass through as they are. Only RELAYED_ROUTES are relayed (/v1/models, the
completions, vLLM's /tokenize, /detokenize and /version). /health is 200 {"status": "ok"} with every replica live,
200 {"status": "degraded"} (header X-Pagedserve-Health: degraded) while some are down or
restarting, and 503 with none; the replicas' details come with it only for a caller holding
the API key. /metrics merges every live replica's series under a `replica` label.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import hmac
import json
import logging
from contextlib import asynccontextmanager
from typing import Any, AsyncIterator

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import ValidationError

from pagedserve.entrypoints.openai.http_errors import error_response as _error
from pagedserve.entrypoints.openai.http_errors import install_error_handlers
from pagedserve.entrypoints.openai.middleware import APIKeyMiddleware, BodyLimitMiddleware, HostCheckMiddleware
from pagedserve.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
from pagedserve.entrypoints.openai.serving_common import (SSE_DONE, APIError, ClientDisconnected, error_event,
                                                          until_disconnected)
from pagedserve.serving.metrics_merge import merge_replica_metrics
from pagedserve.serving.pool import NoReplicaAvailable, ReplicaFailed, ReplicaPool
from pagedserve.serving.prefix_key import chat_token_ids, kept_prompt_ids, prefix_block_hashes, request_token_ids

logger = logging.getLogger("pagedserve.dp")


def with_request_id(body: bytes, request_id: str) -> bytes:
    """The body with request_id set from the client's X-Request-Id header, which names the
    response on a replica as it does in vLLM (serving_common.request_ids): replicas see only the
    body. A body that is no JSON object goes as it came (the replica answers it)."""
    try:
        obj = json.loads(body)
    except ValueError:
        return body
    if not isinstance(obj, dict):
        return body
    obj["request_id"] = request_id
    return json.dumps(obj).encode()


async def merged_metrics(pool: ReplicaPool) -> str:
    """Every live replica's /metrics under a `replica` label, and the router's own series; a relay
    worker's pool (relay_worker.py) asks the front end that routes."""
    own = getattr(pool, "metrics_text", None)
    if own is not None:
        return await own()
    return merge_replica_metrics(await pool.metrics_texts(), pool.router_metrics())


class Drain:
    """Set when the server's shutdown timeout passes (http_server.GracefulServer's
    on_drain_timeout): relays still running then end cleanly, as the single server's do: a
    stream with an error event and [DONE] at its next chunk, any other answer as a 503."""

    def __init__(self) -> None:
        self.expired = asyncio.Event()

    def expire(self) -> None:
        self.expired.set()

    def error(self) -> APIError:
        return APIError("the server is shutting down", 503, type="server_error", code="server_shutting_down")

    async def race(self, coro) -> Any:
        """coro's result, unless the drain expires first: then coro is cancelled and the
        error raised."""
        work = asyncio.ensure_future(coro)
        waiter = asyncio.ensure_future(self.expired.wait())
        try:
            await asyncio.wait({work, waiter}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            waiter.cancel()
            if not work.done():
                work.cancel()
                await asyncio.gather(work, return_exceptions=True)
        if work.cancelled():
            raise self.error()
        return work.result()

    async def stream(self, chunks) -> AsyncIterator[bytes]:
        """chunks, ended cleanly once the drain expires (one flag test per chunk: this is the
        path of every streamed token)."""
        it = chunks.__aiter__()
        try:
            async for chunk in it:
                if self.expired.is_set():
                    yield (error_event(self.error()) + SSE_DONE).encode()
                    return
                yield chunk
        finally:
            await it.aclose()


# What the front end relays to a replica; the first two are routed by their prompt's prefix.
RELAYED_ROUTES = (("POST", "/v1/completions"), ("POST", "/v1/chat/completions"), ("GET", "/v1/models"),
                  ("POST", "/tokenize"), ("POST", "/detokenize"), ("GET", "/version"))


def build_dp_app(pool: ReplicaPool, tokenizer: Any, block_size: int, api_key: str | None = None,
                 max_request_bytes: int = 1 << 20, manage_pool: bool = True,
                 after_start=None, before_stop=None, allowed_hosts: list[str] | None = None,
                 chat_template_content_format: str = "auto") -> FastAPI:
    """manage_pool: start the pool with the app and stop it with the app. after_start /
    before_stop: async callables run once the pool is up / before it stops (relay workers).
    allowed_hosts: see middleware.HostCheckMiddleware (None: any Host). app.state.drain: the
    Drain to expire when the shutdown timeout passes. chat_template_content_format: the
    replicas' --chat-template-content-format, so chat keys are the ids they render."""
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
    drain = app.state.drain = Drain()
    install_error_handlers(app)  # every error body in OpenAI's schema, as the single server's
    expected = f"Bearer {api_key}".encode() if api_key else None

    def has_key(request: Request) -> bool:
        got = request.headers.get("authorization", "").encode()
        return expected is None or hmac.compare_digest(got, expected)

    def routing_key(path: str, body: bytes) -> list[bytes]:
        """Validates the body as the replica will (a bad one answers 400 here, named as the
        single server names it, before any routing), then hashes its prompt."""
        model = CompletionRequest if path == "/v1/completions" else ChatCompletionRequest
        try:
            req = model.model_validate_json(body)
        except ValidationError as e:
            raise RequestValidationError(e.errors(include_url=False)) from None
        if path == "/v1/chat/completions":  # rendered from the validated request, as the replica does
            ids = kept_prompt_ids(None, chat_token_ids(tokenizer, req, chat_template_content_format),
                                  req.truncate_prompt_tokens, req.truncation_side)
        else:  # the ids truncate_prompt_tokens keeps, a text prompt cut as the replica's tokenizer cuts it
            ids = request_token_ids(tokenizer, path, body)
        return prefix_block_hashes(ids, block_size, cache_salt=req.cache_salt)

    @app.get("/health")
    @app.get("/ping", include_in_schema=False)  # vLLM's alias (SageMaker's health check)
    @app.post("/ping", include_in_schema=False)
    async def health(request: Request) -> Response:
        """Live, degraded or down for anyone; the replicas' internals (URLs, pids, loads) only
        with the API key, when the front end has one."""
        h = await pool.health()
        if h["status"] == "down":
            return JSONResponse(h if has_key(request) else {"status": h["status"]}, status_code=503)
        return JSONResponse(h if has_key(request) else {"status": h["status"]},
                            headers={"X-Pagedserve-Health": h["status"]})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(await merged_metrics(pool), media_type=CONTENT_TYPE_LATEST)

    async def relay(path: str, request: Request) -> Response:
        body = await request.body()
        hashes: list[bytes] = []
        if path in ("/v1/completions", "/v1/chat/completions"):  # the others: any replica
            loop = asyncio.get_running_loop()
            if "x-request-id" in request.headers:  # (a JSON round trip: off the event loop too)
                body = await loop.run_in_executor(tokenize, with_request_id, body, request.headers["x-request-id"])
            hashes = await loop.run_in_executor(tokenize, routing_key, path, body)
        try:
            # A client that leaves before the answer starts cancels the relay, and the closed
            # upstream connection tells the replica to abort (streams: StreamingResponse's own
            # disconnect watch closes them).
            resp = await until_disconnected(request, drain.race(pool.forward(request.method, path, body, hashes)))
        except ClientDisconnected:
            return Response(status_code=499)
        except APIError as e:
            return _error(e.status, e.message, type=e.type, code=e.code)
        except NoReplicaAvailable as e:
            return _error(503, str(e), type="server_error", code="no_replica_available")
        except ReplicaFailed as e:
            return _error(503, str(e), type="server_error", code="replica_failed")
        if resp.content_type.startswith("text/event-stream"):
            return StreamingResponse(drain.stream(resp.chunks), status_code=resp.status,
                                     media_type=resp.content_type,
                                     headers={"Cache-Control": "no-cache"})
        data = b"".join([c async for c in resp.chunks])
        return Response(data, status_code=resp.status, media_type=resp.content_type, headers=resp.headers)

    # Only the routes the front end serves are relayed: nothing else of a replica (its
    # dashboard, /kv_cache, /metrics, /openapi.json) is reachable through the front end.
    def relayed(path: str):
        async def route(request: Request) -> Response:
            return await relay(path, request)
        return route

    for method, path in RELAYED_ROUTES:
        app.add_api_route(path, relayed(path), methods=[method])

    app.add_middleware(BodyLimitMiddleware, max_bytes=max_request_bytes)
    if api_key:
        app.add_middleware(APIKeyMiddleware, api_key=api_key)
    if allowed_hosts is not None:
        app.add_middleware(HostCheckMiddleware, allowed=allowed_hosts)
    return app
