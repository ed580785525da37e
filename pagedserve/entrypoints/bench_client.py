"""One streamed completion of `pagedserve bench serve`, over aiohttp or httpx.

send_request sends a workload request to /v1/completions (streamed, ignore_eos, usage in the
stream) and reads its SSE events into a RequestResult: TTFT to the first streamed choice, the gaps
between the following ones, output tokens from the server's usage. make_client opens the client
the requests share: aiohttp where installed (its C parser: about a third of httpx's CPU per
streamed event), httpx otherwise or on request ($PAGEDSERVE_BENCH_CLIENT), with the same pool and
timeouts; the bytes sent and the records kept are the same either way.
"""
from __future__ import annotations

import asyncio
import json
import os
import time
from typing import Any

import httpx

try:
    import aiohttp
except ImportError:  # pragma: no cover - a dependency; httpx does the same, dearer per event
    aiohttp = None

from pagedserve.entrypoints.bench_stats import RequestResult, describe_error
from pagedserve.entrypoints.http_stack import CLIENT_KEEP_ALIVE_S
from pagedserve.workloads import WorkloadRequest


async def send_request(client: Any, base_url: str, model: str, req: WorkloadRequest,
                       headers: dict, temperature: float, retries: int = 0) -> RequestResult:
    """One streamed completion. retries: how many more times a request is sent when it failed
    with a network or protocol error before any status line came back (a timeout is not
    retried); one that got a response is never sent twice. Its times are the last attempt's."""
    attempt = 0
    while True:
        res, unanswered = await _send_once(client, base_url, model, req, headers, temperature)
        if res.error is None or not unanswered or attempt == retries:
            res.retries = attempt
            return res
        attempt += 1


class _Stream:
    """What one streamed request has seen so far: its SSE lines go in, its record comes out."""

    def __init__(self, req: WorkloadRequest) -> None:
        self.res = RequestResult(prompt_len=len(req.prompt_token_ids), expected_output_len=req.output_len)
        self.start = self.last = time.perf_counter()
        self.chunks_with_text = 0
        self.done = False

    def line(self, line: str) -> None:
        # Read to the end of the body, past [DONE], whatever comes: a client closes a connection
        # whose response was left unread instead of reusing it, so the client opened one connection
        # per request (4,968 client ports for 5,360 requests in a CPU run), each left in TIME_WAIT
        # for a minute: at hundreds of requests a second that runs the machine out of ports. A run
        # on the H200 (60,000 requests, 4,096 in flight) lost 2,024 to ConnectError and ReadError,
        # most likely this.
        if self.done or not line.startswith("data:"):
            return
        data = line[5:].strip()
        if data == "[DONE]":
            self.done = True
            return
        chunk = json.loads(data)
        res = self.res
        if "error" in chunk:
            res.error = json.dumps(chunk["error"])[:300]
            self.done = True
            return
        now = time.perf_counter()
        if chunk.get("choices"):
            self.chunks_with_text += 1
            if res.ttft is None:
                res.ttft = now - self.start
            else:
                res.itl.append(now - self.last)
            self.last = now
        if chunk.get("usage"):
            res.output_len = int(chunk["usage"].get("completion_tokens") or 0)

    def end(self) -> RequestResult:
        res = self.res
        res.latency = time.perf_counter() - self.start
        if res.output_len == 0:  # server without usage in streams: one token per chunk
            res.output_len = self.chunks_with_text
        return res


def _payload(model: str, req: WorkloadRequest, temperature: float) -> dict:
    return {"model": model, "prompt": req.prompt_token_ids, "max_tokens": req.output_len,
            "temperature": temperature, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}, **(req.extra_body or {})}


async def _send_once(client: Any, base_url: str, model: str, req: WorkloadRequest,
                     headers: dict, temperature: float) -> tuple[RequestResult, bool]:
    """(result, whether it failed with a network or protocol error before any status line).
    client: an aiohttp.ClientSession or an httpx.AsyncClient."""
    if aiohttp is not None and isinstance(client, aiohttp.ClientSession):
        return await _send_once_aiohttp(client, base_url, model, req, headers, temperature)
    st = _Stream(req)
    answered = unanswered = False
    try:
        async with client.stream("POST", f"{base_url}/completions", json=_payload(model, req, temperature),
                                 headers=headers) as r:
            answered = True
            if r.status_code != 200:
                st.res.error = f"HTTP {r.status_code}: {(await r.aread()).decode(errors='replace')[:300]}"
                return st.end(), False
            async for line in r.aiter_lines():
                st.line(line)
    except (httpx.HTTPError, json.JSONDecodeError) as e:
        st.res.error = describe_error(e)
        unanswered = not answered and isinstance(e, (httpx.NetworkError, httpx.RemoteProtocolError))
    return st.end(), unanswered


async def _send_once_aiohttp(session: Any, base_url: str, model: str, req: WorkloadRequest,
                             headers: dict, temperature: float) -> tuple[RequestResult, bool]:
    """_send_once over aiohttp: its C parser costs the client about a third of httpx's CPU per
    streamed event (serving/relay_clients.py), and at 40 req/s on the H200's hosts one httpx
    client process needed more than a core (docs/benchmarks-history.md)."""
    st = _Stream(req)
    answered = unanswered = False
    try:
        async with session.post(f"{base_url}/completions", json=_payload(model, req, temperature),
                                headers=headers) as r:
            answered = True
            if r.status != 200:
                st.res.error = f"HTTP {r.status}: {(await r.read()).decode(errors='replace')[:300]}"
                return st.end(), False
            async for raw in r.content:  # one line at a time, b"\n" included
                st.line(raw.decode())
    except (aiohttp.ClientError, asyncio.TimeoutError, json.JSONDecodeError) as e:
        st.res.error = describe_error(e)
        # A timeout is not retried, as with httpx (aiohttp's read timeout is a connection error too).
        unanswered = not answered and isinstance(e, aiohttp.ClientConnectionError) \
            and not isinstance(e, asyncio.TimeoutError)
    return st.end(), unanswered


def client_limits(connections: int) -> httpx.Limits:
    """The benchmark client's pool: a connection per request in flight, each dropped after
    CLIENT_KEEP_ALIVE_S idle, before the server's keep-alive closes it. (At httpx's default, 5 s,
    as long as the servers', a 60,000-request run saw 52 requests reset: each sent down a
    connection the server was closing.)"""
    return httpx.Limits(max_connections=connections, max_keepalive_connections=connections,
                        keepalive_expiry=CLIENT_KEEP_ALIVE_S)


BENCH_CLIENT_ENV = "PAGEDSERVE_BENCH_CLIENT"
BENCH_CLIENTS = ("aiohttp", "httpx")


def bench_client() -> str:
    """The HTTP client the requests stream over: $PAGEDSERVE_BENCH_CLIENT (aiohttp | httpx), else
    aiohttp where installed. The same bytes either way; aiohttp parses them for less CPU."""
    name = os.environ.get(BENCH_CLIENT_ENV) or ("aiohttp" if aiohttp is not None else "httpx")
    if name not in BENCH_CLIENTS:
        raise ValueError(f"{BENCH_CLIENT_ENV} must be one of {BENCH_CLIENTS}, got {name!r}")
    if name == "aiohttp" and aiohttp is None:
        raise ValueError(f"{BENCH_CLIENT_ENV}=aiohttp but aiohttp is not installed")
    return name


def make_client(kind: str, connections: int, timeout: float) -> Any:
    """An aiohttp session or an httpx client with the same pool (client_limits) and timeouts:
    `timeout` for connecting and for every read, none for the whole request."""
    if kind == "httpx":
        return httpx.AsyncClient(timeout=httpx.Timeout(timeout), limits=client_limits(connections))
    connector = aiohttp.TCPConnector(limit=connections, keepalive_timeout=CLIENT_KEEP_ALIVE_S)
    return aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(
        total=None, sock_connect=timeout, sock_read=timeout))
