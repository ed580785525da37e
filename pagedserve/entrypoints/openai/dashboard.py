"""The live KV page-map of `pagedserve serve`: GET /dashboard, GET /kv_cache/state (JSON) and
GET /kv_cache/events (server-sent events: a full frame, then only the cells that changed).

With --api-key, both data endpoints need `Authorization: Bearer <key>`, as /v1/* does. The page
gets the key from the URL fragment (/dashboard#key=...; a fragment never reaches the server or
its logs) or asks for it, and sends it as that header: it reads the event stream with fetch()
rather than EventSource, which cannot set headers, so the key never travels in a URL.
"""
from __future__ import annotations

import hmac
from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import StreamingResponse

from pagedserve.dashboard.feed import ThrottledSnapshot, parse_interval, public_state, sse_frames
from pagedserve.dashboard.page import page_router
from pagedserve.entrypoints.openai.serving_common import APIError


def bearer_key_check(api_key: str | None):
    """A dependency that answers 401 unless the request carries the server's API key."""
    expected = f"Bearer {api_key}".encode() if api_key else None

    async def check(request: Request) -> None:
        if expected is None:
            return
        got = request.headers.get("authorization", "").encode()
        if not hmac.compare_digest(got, expected):
            raise APIError("Incorrect or missing API key: send it as 'Authorization: Bearer <key>'",
                           401, code="invalid_api_key")
    return check


def _token_totals(engine: Any) -> dict:
    """Token counters from the server's metrics, so the page can draw throughput."""
    registry = engine.metrics.registry
    return {"metrics": {name: registry.get_sample_value(f"pagedserve:{name}") or 0.0
                        for name in ("generation_tokens_total", "prompt_tokens_total")}}


def dashboard_router(engine: Any, api_key: str | None) -> APIRouter:
    """Everything the dashboard needs from a running server, as one router to include."""
    feed = ThrottledSnapshot(engine.get_kv_cache_state, extra=lambda: _token_totals(engine))
    router = APIRouter()
    router.include_router(page_router({"mode": "live", "needs_key": api_key is not None}))
    auth = [Depends(bearer_key_check(api_key))]

    @router.get("/kv_cache/state", dependencies=auth, include_in_schema=False)
    async def kv_cache_state() -> dict:
        return public_state(await feed.get())

    @router.get("/kv_cache/events", dependencies=auth, include_in_schema=False)
    async def kv_cache_events(request: Request) -> StreamingResponse:
        try:
            interval = parse_interval(request.query_params.get("interval"))
        except ValueError as e:
            raise APIError(str(e), 400, param="interval") from None
        return StreamingResponse(sse_frames(feed, interval), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    return router
