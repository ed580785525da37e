"""http_server.make_server's limits, in process on loopback with a trivial app and short limits:
a request head must arrive within its timeout (else 408, or a plain close when nothing came), a
body within BodyLimitMiddleware's, and past the connection cap new requests are answered 503
and logged, while the server keeps answering."""
from __future__ import annotations

import json
import logging
import signal
import socket
import threading
import time

import pytest

from pagedserve.benchmark.server_process import free_port
from pagedserve.entrypoints.http_server import make_server
from pagedserve.entrypoints.openai.middleware import BodyLimitMiddleware


async def _ok(scope, receive, send):
    if scope["type"] == "lifespan":
        while True:
            msg = await receive()
            if msg["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            elif msg["type"] == "lifespan.shutdown":
                await send({"type": "lifespan.shutdown.complete"})
                return
    if scope["method"] == "POST":
        while (await receive()).get("more_body"):
            pass
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
    await send({"type": "http.response.body", "body": b"ok"})


@pytest.fixture(scope="module")
def limited():
    """A server with a 0.5 s head timeout, 0.5 s body-read timeout and a cap of 6 connections."""
    port = free_port()
    server = make_server(BodyLimitMiddleware(_ok, 1000, read_timeout_s=0.5), "127.0.0.1", port,
                         header_timeout_s=0.5, limit_concurrency=6, log_level="warning")
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.05)
    assert server.started
    yield ("127.0.0.1", port)
    server.should_exit = True
    thread.join(10)


def _read_all(s: socket.socket, timeout: float = 5.0) -> bytes:
    """Everything until the server closes; socket.timeout if it has not closed within timeout."""
    s.settimeout(timeout)
    got = b""
    while True:
        try:
            chunk = s.recv(65536)
        except ConnectionResetError:
            break
        if not chunk:
            break
        got += chunk
    return got


def _get(addr) -> int:
    with socket.create_connection(addr, timeout=5) as s:
        s.sendall(b"GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        return int(_read_all(s).split()[1])


def test_a_half_sent_head_is_answered_408_and_closed(limited):
    with socket.create_connection(limited, timeout=5) as s:
        s.sendall(b"GET / HTTP/1.1\r\nHost: x\r\nX-Slow: ")
        got = _read_all(s)  # within the bounded read: the server closed it
    assert got.startswith(b"HTTP/1.1 408"), got[:100]
    assert json.loads(got.partition(b"\r\n\r\n")[2])["error"]["code"] == "request_timeout"


def test_an_idle_connection_is_closed(limited):
    with socket.create_connection(limited, timeout=5) as s:
        assert _read_all(s) == b""  # closed by the server, nothing said


def test_a_dribbled_body_is_answered_408(limited):
    with socket.create_connection(limited, timeout=5) as s:
        s.sendall(b"POST / HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 100\r\n\r\n{")
        got = _read_all(s)
    assert got.startswith(b"HTTP/1.1 408"), got[:100]


def test_past_the_connection_cap_requests_get_503_and_a_log_line(limited, caplog):
    held = [socket.create_connection(limited, timeout=5) for _ in range(6)]
    try:
        with caplog.at_level(logging.WARNING, logger="uvicorn.error"):
            assert _get(limited) == 503
        assert "Exceeded concurrency limit." in caplog.text
    finally:
        for s in held:
            s.close()
    deadline = time.monotonic() + 5
    while _get(limited) != 200:  # the held ones are gone: served again
        assert time.monotonic() < deadline
        time.sleep(0.05)


def test_a_second_signal_forces_the_exit():
    """The first SIGTERM drains; a second one (of any kind: uvicorn forces only on a second
    SIGINT) stops waiting at once."""
    server = make_server(_ok, "127.0.0.1", free_port())
    server.handle_exit(signal.SIGTERM, None)
    assert server.should_exit and not server.force_exit
    server.handle_exit(signal.SIGTERM, None)
    assert server.force_exit
