"""The benchmark client over aiohttp (its default where installed), against a raw HTTP/1.1 server
on a socket: the same records as over httpx, a stream read to its end so the connection is
reused, retries only for requests that got no response, and the switch that picks the client."""
from __future__ import annotations

import asyncio

import pytest

from pagedserve.entrypoints import bench_client
from pagedserve.entrypoints.bench_client import send_request
from pagedserve.workloads import WorkloadRequest

aiohttp = pytest.importorskip("aiohttp")

EVENTS = [b'data: {"choices": [{"text": "a"}]}\n\n', b'data: {"choices": [{"text": "b"}]}\n\n',
          b'data: {"choices": [], "usage": {"completion_tokens": 2}}\n\n', b"data: [DONE]\n\n"]


def chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


class RawServer:
    """Answers POSTs by their x-case header: ok (a chunked SSE stream, keep-alive), unanswered-once
    (the first such request's connection closed before any status line), midstream (a 200, one
    event, then the connection closed inside the chunked body)."""

    def __init__(self) -> None:
        self.connections = 0
        self.requests: list[str] = []

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                lines = head.decode().split("\r\n")
                fields = {k.lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines[1:] if ln)}
                await reader.readexactly(int(fields.get("content-length", 0)))
                case = fields.get("x-case", "ok")
                self.requests.append(case)
                if case == "unanswered-once" and self.requests.count(case) == 1:
                    writer.close()
                    return
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                             b"transfer-encoding: chunked\r\n\r\n")
                if case == "midstream":
                    writer.write(chunk(EVENTS[0]))
                    await writer.drain()
                    writer.close()
                    return
                for e in EVENTS:
                    writer.write(chunk(e))
                writer.write(b"0\r\n\r\n")
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()


def run_requests(cases: list[str], retries: int = 0) -> tuple[list, RawServer]:
    server = RawServer()

    async def main():
        srv = await asyncio.start_server(server.handle, "127.0.0.1", 0)
        port = srv.sockets[0].getsockname()[1]
        out = []
        async with bench_client.make_client("aiohttp", 4, 30.0) as client:
            for case in cases:
                req = WorkloadRequest(prompt_token_ids=[1, 2], output_len=2, arrival_time=0.0)
                out.append(await send_request(client, f"http://127.0.0.1:{port}/v1", "m", req,
                                              {"x-case": case}, 0.0, retries=retries))
        srv.close()
        await srv.wait_closed()
        return out
    return asyncio.run(main()), server


def test_a_stream_gives_its_record_and_its_connection_serves_the_next_request():
    results, server = run_requests(["ok", "ok", "ok"])
    for r in results:
        assert r.error is None and r.output_len == 2 and len(r.itl) == 1
        assert 0 < r.ttft <= r.latency
    assert server.connections == 1  # read past [DONE] to the end: the connection was reused


def test_retry_only_requests_that_got_no_response():
    failed, _ = run_requests(["unanswered-once"], retries=0)
    assert failed[0].error is not None and failed[0].retries == 0
    retried, server = run_requests(["unanswered-once"], retries=1)
    assert retried[0].error is None and retried[0].output_len == 2 and retried[0].retries == 1
    assert server.requests == ["unanswered-once"] * 2
    midstream, server = run_requests(["midstream"], retries=1)
    assert midstream[0].error is not None and midstream[0].retries == 0 and server.requests == ["midstream"]
    assert "\n" not in midstream[0].error


def test_the_switch_picks_the_client(monkeypatch):
    monkeypatch.delenv(bench_client.BENCH_CLIENT_ENV, raising=False)
    assert bench_client.bench_client() == "aiohttp"
    monkeypatch.setenv(bench_client.BENCH_CLIENT_ENV, "httpx")
    assert bench_client.bench_client() == "httpx"
    monkeypatch.setenv(bench_client.BENCH_CLIENT_ENV, "curl")
    with pytest.raises(ValueError, match=bench_client.BENCH_CLIENT_ENV):
        bench_client.bench_client()
