"""The uvicorn server of `pagedserve serve` (single server, DP front end, relay workers), hardened.

uvicorn bounds neither a request's head nor the time a client takes to send it, and on a
signal it waits for open connections without limit. Here:

- Header size: the request line and headers together may be at most MAX_HEADER_BYTES; more
  answers 431 and closes (httptools: counted as bytes arrive, before the parser buffers them;
  h11: its own `h11_max_incomplete_event_size`, which answers 400).
- Header read time: a connection must send a complete request head within HEADER_TIMEOUT_S of
  opening (or of its first byte after a keep-alive pause): else 408 (or a plain close, when it
  sent nothing) frees its descriptor. Bodies: middleware.BodyLimitMiddleware's read timeout.
- Connections: at most `limit_concurrency` (default: from the open-file limit) connections and
  tasks; beyond it uvicorn answers 503 and logs "Exceeded concurrency limit.".
- Parser errors (bad Content-Length, an unknown method) answer OpenAI-style JSON, not text.
- Shutdown (SIGTERM/SIGINT): stop accepting, let requests in flight finish for up to
  `shutdown_timeout` seconds, then `on_drain_timeout()` ends the rest cleanly (the app answers
  them: SSE error event + [DONE], or 503 JSON); a second signal exits at once.
"""
from __future__ import annotations

import asyncio
import json
import logging
import signal
from typing import Any, Callable

import uvicorn

from pagedserve.entrypoints.http_stack import SERVER_KEEP_ALIVE_S, http_stack

logger = logging.getLogger("pagedserve.server")

MAX_HEADER_BYTES = 64 * 1024   # nginx's default large_client_header_buffers is 4 x 8 KiB
HEADER_TIMEOUT_S = 10.0
DEFAULT_SHUTDOWN_TIMEOUT_S = 10.0
FD_RESERVE = 256               # descriptors kept for everything but client connections
_END_OF_HEAD = b"\r\n\r\n"


def _json_error(status: int, reason: str, message: str, code: str) -> bytes:
    body = json.dumps({"error": {"message": message, "type": "invalid_request_error",
                                 "param": None, "code": code}}).encode()
    return (f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\nconnection: close\r\n\r\n").encode() + body


def guarded_httptools_protocol(max_header_bytes: int = MAX_HEADER_BYTES,
                               header_timeout_s: float = HEADER_TIMEOUT_S) -> type:
    """uvicorn's httptools protocol with the head bounded in size and in time."""
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    class GuardedHttpToolsProtocol(HttpToolsProtocol):
        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._head_bytes = 0
            self._head_tail = b""
            self._awaiting_head = True
            self._head_timer = self.loop.call_later(header_timeout_s, self._head_timed_out)

        def _head_timed_out(self) -> None:
            self._head_timer = None
            if not self._awaiting_head or self.transport.is_closing():
                return
            if self._head_bytes:
                self.transport.write(_json_error(408, "Request Timeout", f"request head not received "
                                                 f"within {header_timeout_s:g} s", "request_timeout"))
            self.transport.close()

        def _stop_head_timer(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None

        def connection_lost(self, exc) -> None:
            self._stop_head_timer()
            super().connection_lost(exc)

        def data_received(self, data: bytes) -> None:
            if self._awaiting_head:
                if self._head_timer is None and self._idle():  # first byte after a keep-alive pause
                    self._head_timer = self.loop.call_later(header_timeout_s, self._head_timed_out)
                seen = self._head_tail + data
                end = seen.find(_END_OF_HEAD)
                head = self._head_bytes + (len(data) if end < 0 else end + 4 - len(self._head_tail))
                if head > max_header_bytes:
                    self.logger.warning("request head over %d bytes from %s: 431", max_header_bytes,
                                        self.client)
                    self.transport.write(_json_error(431, "Request Header Fields Too Large",
                                                     f"request line and headers exceed {max_header_bytes} bytes",
                                                     "request_header_fields_too_large"))
                    self.transport.close()
                    self._awaiting_head = False
                    self._stop_head_timer()
                    return
                self._head_bytes = head
                self._head_tail = seen[-3:]
            super().data_received(data)

        def on_headers_complete(self) -> None:
            self._awaiting_head = False
            self._stop_head_timer()
            super().on_headers_complete()

        def _idle(self) -> bool:
            return self.cycle is None or self.cycle.response_complete

        def on_message_complete(self) -> None:
            # The request's body is in: what comes next is the head of the next one. (Not at
            # the response's end: an early answer, say a 413, leaves the body still arriving.)
            self._awaiting_head, self._head_bytes, self._head_tail = True, 0, b""
            super().on_message_complete()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if self._awaiting_head and self._head_bytes and self._head_timer is None:
                self._head_timer = self.loop.call_later(header_timeout_s, self._head_timed_out)

        def send_400_response(self, msg: str) -> None:
            self.transport.write(_json_error(400, "Bad Request", msg, "invalid_http_request"))
            self.transport.close()

    return GuardedHttpToolsProtocol


def default_limit_concurrency() -> int | None:
    """Connections (and tasks) at once: what the open-file limit leaves after FD_RESERVE, so a
    flood is answered 503 and logged instead of exhausting descriptors silently."""
    try:
        import resource
    except ImportError:
        return None
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    if soft == resource.RLIM_INFINITY:
        return None
    return max(64, soft - FD_RESERVE)


class GracefulServer(uvicorn.Server):
    """uvicorn.Server with a bounded, clean drain and a second signal that exits at once."""

    def __init__(self, config: uvicorn.Config, shutdown_timeout: float,
                 on_drain_timeout: Callable[[], Any] | None = None) -> None:
        super().__init__(config)
        self.shutdown_timeout = shutdown_timeout
        self.on_drain_timeout = on_drain_timeout
        self.draining = False

    def handle_exit(self, sig: int, frame) -> None:
        if self.should_exit:
            logger.warning("second %s: exiting now", signal.Signals(sig).name)
            self.force_exit = True  # uvicorn forces only on a second SIGINT
        super().handle_exit(sig, frame)

    async def shutdown(self, sockets=None) -> None:
        self.draining = True
        n = len(self.server_state.tasks)
        logger.info("shutting down: no new connections; %d request(s) in flight get up to %g s to finish",
                    n, self.shutdown_timeout)
        loop = asyncio.get_running_loop()
        timer = loop.call_later(self.shutdown_timeout, self._drain_timed_out)
        try:
            await super().shutdown(sockets)
        finally:
            timer.cancel()

    def _drain_timed_out(self) -> None:
        n = len(self.server_state.tasks)
        if n:
            logger.warning("shutdown timeout (%g s): ending %d request(s) still in flight",
                           self.shutdown_timeout, n)
        if self.on_drain_timeout is not None:
            self.on_drain_timeout()


def make_server(app: Any, host: str | None = None, port: int | None = None, *,
                shutdown_timeout: float = DEFAULT_SHUTDOWN_TIMEOUT_S,
                on_drain_timeout: Callable[[], Any] | None = None,
                log_level: str = "info", access_log: bool = True,
                limit_concurrency: int | None = None,
                max_header_bytes: int = MAX_HEADER_BYTES,
                header_timeout_s: float = HEADER_TIMEOUT_S, **uvicorn_kw: Any) -> GracefulServer:
    """The hardened uvicorn server; run it with .run() or .run(sockets=[...]). uvicorn_kw: more of
    uvicorn.Config's keywords (TLS and root_path: http_options.uvicorn_options)."""
    kw: dict[str, Any] = dict(uvicorn_kw)
    if http_stack()["http"] == "httptools":
        kw["http"] = guarded_httptools_protocol(max_header_bytes, header_timeout_s)
    else:
        kw["http"] = "h11"
        kw["h11_max_incomplete_event_size"] = max_header_bytes
    config = uvicorn.Config(
        app, host=host or "127.0.0.1", port=port or 8000, log_level=log_level, access_log=access_log,
        timeout_keep_alive=SERVER_KEEP_ALIVE_S,
        limit_concurrency=limit_concurrency if limit_concurrency is not None else default_limit_concurrency(),
        # The backstop: on_drain_timeout has ended every request by then; what still runs is cut.
        timeout_graceful_shutdown=shutdown_timeout + 2.0,
        log_config=None,  # uvicorn's lines propagate to pagedserve's one format (log_setup.py)
        **kw)
    return GracefulServer(config, shutdown_timeout, on_drain_timeout)
