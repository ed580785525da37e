"""The HTTP clients the mp front end relays requests with, behind one small interface.

aiohttp where installed (a C parser: about a third of httpx's CPU per streamed event), httpx
otherwise or on request ($PAGEDSERVE_DP_RELAY_CLIENT). Each client maps its own errors onto
the two the pool's fault contract needs (mp_pool.py): NotDelivered (the replica never got the
request: safe to send elsewhere) and Lost (it got it and went away).
"""
from __future__ import annotations

import asyncio
import os
from typing import AsyncIterator

import httpx

from pagedserve.entrypoints.http_stack import CLIENT_KEEP_ALIVE_S

try:
    import aiohttp
except ImportError:  # pragma: no cover - httpx does the same, dearer per streamed event
    aiohttp = None

RELAY_CLIENTS = ("aiohttp", "httpx")
# Replicas close idle connections after SERVER_KEEP_ALIVE_S: the relay drops its own idle ones
# sooner (CLIENT_KEEP_ALIVE_S), so it never sends a request down one the replica is closing.
JSON = {"content-type": "application/json"}


class NotDelivered(Exception):
    """The connection failed before the request went out."""


class Lost(Exception):
    """The request went out and its replica failed before answering in full."""


def default_relay_client() -> str:
    """$PAGEDSERVE_DP_RELAY_CLIENT (aiohttp | httpx), else aiohttp if installed, else httpx."""
    name = os.environ.get("PAGEDSERVE_DP_RELAY_CLIENT") or ("aiohttp" if aiohttp else "httpx")
    if name not in RELAY_CLIENTS:
        raise ValueError(f"PAGEDSERVE_DP_RELAY_CLIENT must be one of {RELAY_CLIENTS}, got {name!r}")
    if name == "aiohttp" and aiohttp is None:
        raise ValueError("PAGEDSERVE_DP_RELAY_CLIENT=aiohttp but aiohttp is not installed")
    return name


class HttpxRelay:
    def __init__(self) -> None:
        # (A larger keep-alive pool costs more here than it saves: httpcore scans its whole pool
        # for every request and response.)
        self.client = httpx.AsyncClient(timeout=httpx.Timeout(None, connect=5.0),
                                        limits=httpx.Limits(max_connections=None, max_keepalive_connections=64,
                                                            keepalive_expiry=CLIENT_KEEP_ALIVE_S))

    async def send(self, method: str, url: str, body: bytes, headers: dict | None = None) -> httpx.Response:
        request = self.client.build_request(method, url, content=body or None, headers={**JSON, **(headers or {})})
        try:
            return await self.client.send(request, stream=True)
        except (httpx.ConnectError, httpx.ConnectTimeout) as e:
            raise NotDelivered(repr(e)) from None
        except httpx.HTTPError as e:
            raise Lost(repr(e)) from None

    @staticmethod
    def head(resp: httpx.Response) -> tuple[int, str]:
        return resp.status_code, resp.headers.get("content-type", "application/json")

    @staticmethod
    def retry_after(resp: httpx.Response) -> str | None:
        return resp.headers.get("retry-after")

    async def read(self, resp: httpx.Response) -> bytes:
        try:
            return await resp.aread()
        except httpx.HTTPError as e:
            raise Lost(repr(e)) from None

    async def chunks(self, resp: httpx.Response) -> AsyncIterator[bytes]:
        try:
            async for chunk in resp.aiter_raw():
                yield chunk
        except httpx.HTTPError as e:
            raise Lost(repr(e)) from None

    async def close(self, resp: httpx.Response, complete: bool) -> None:
        await resp.aclose()

    async def aclose(self) -> None:
        await self.client.aclose()


class AiohttpRelay:
    def __init__(self) -> None:
        # Every request in flight holds one connection: aiohttp keeps them all for reuse.
        self.session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=CLIENT_KEEP_ALIVE_S),
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=5.0), auto_decompress=False)

    async def send(self, method: str, url: str, body: bytes, headers: dict | None = None):
        try:
            return await self.session.request(method, url, data=body or None, headers={**JSON, **(headers or {})})
        except (aiohttp.ClientConnectorError, asyncio.TimeoutError) as e:
            # Refused, or no connection within sock_connect.
            raise NotDelivered(repr(e)) from None
        except aiohttp.ClientError as e:
            raise Lost(repr(e)) from None

    @staticmethod
    def head(resp) -> tuple[int, str]:
        return resp.status, resp.headers.get("content-type", "application/json")

    @staticmethod
    def retry_after(resp) -> str | None:
        return resp.headers.get("retry-after")

    async def read(self, resp) -> bytes:
        try:
            return await resp.read()
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            raise Lost(repr(e)) from None

    async def chunks(self, resp) -> AsyncIterator[bytes]:
        """Whatever one socket read holds: the same bytes, one relay hop for however many events
        came together."""
        try:
            async for chunk in resp.content.iter_any():
                yield chunk
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            raise Lost(repr(e)) from None

    async def close(self, resp, complete: bool) -> None:
        if complete:
            resp.release()  # the connection goes back to the pool
        else:
            resp.close()    # the client left: closing tells the replica to abort

    async def aclose(self) -> None:
        await self.session.close()


def make_relay(name: str):
    return AiohttpRelay() if name == "aiohttp" else HttpxRelay()
