"""ASGI middleware in front of the OpenAI app (single server and DP front end).

Order, outermost first: HostCheck (a DNS-rebinding page sends its own domain as Host),
APIKey (checked before any body is read), BodyLimit (bounded size, bounded read time,
JSON only). Each answers in OpenAI's error schema.
"""
from __future__ import annotations

import asyncio
import hmac
import ipaddress
import socket
from typing import Any, Iterable

from pagedserve.entrypoints.openai.http_errors import error_response

_V1 = "/v1/"
# A client must send each part of a body within this many seconds (slowloris: a body dribbled
# a byte at a time holds a connection and a task forever otherwise).
BODY_READ_TIMEOUT_S = 30.0
WILDCARD_HOSTS = ("0.0.0.0", "::", "")


class BodyLimitMiddleware:
    """Reads at most max_bytes of a request body, each part within read_timeout_s, and only
    `Content-Type: application/json`: more answers 413, slower 408, another type 415 (a web
    page may POST text/plain cross-site without a preflight; JSON needs one)."""

    def __init__(self, app: Any, max_bytes: int, read_timeout_s: float = BODY_READ_TIMEOUT_S) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.read_timeout_s = read_timeout_s

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD", "OPTIONS"):
            return await self.app(scope, receive, send)
        too_big = error_response(413, f"request body exceeds the limit of {self.max_bytes} bytes",
                                 code="request_too_large")
        headers = dict(scope.get("headers", []))
        media_type = headers.get(b"content-type", b"").split(b";")[0].strip().lower()
        has_body = headers.get(b"content-length", b"0") != b"0" or b"transfer-encoding" in headers
        if media_type != b"application/json" and has_body:
            return await error_response(
                415, f"Content-Type must be application/json, got {media_type.decode('latin-1') or 'none'!r}",
                code="unsupported_media_type")(scope, receive, send)
        length = headers.get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > self.max_bytes):
            return await too_big(scope, receive, send)
        chunks, total = [], 0
        while True:
            try:
                message = await asyncio.wait_for(receive(), self.read_timeout_s)
            except asyncio.TimeoutError:
                return await error_response(408, f"request body not received within {self.read_timeout_s:g} s",
                                            code="request_timeout",
                                            headers={"Connection": "close"})(scope, receive, send)
            if message["type"] == "http.disconnect":
                return
            body = message.get("body", b"")
            total += len(body)
            if total > self.max_bytes:
                return await too_big(scope, receive, send)
            chunks.append(body)
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        try:
            body.decode("utf-8")  # JSON over HTTP is UTF-8 (RFC 8259); say where it is not
        except UnicodeDecodeError as e:
            return await error_response(400, f"request body is not valid UTF-8: byte 0x{body[e.start]:02x} "
                                             f"at offset {e.start}", code="invalid_json")(scope, receive, send)
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)


def route_path(scope: dict) -> str:
    """The path routes match: without the --root-path prefix uvicorn puts in front of it (so
    /llm/v1/models under --root-path /llm is /v1/models, and needs the key as /v1/models does)."""
    path, root = scope["path"], scope.get("root_path", "")
    if root and path.startswith(root) and path[len(root):len(root) + 1] in ("", "/"):  # as Starlette's routing
        return path[len(root):]
    return path


class APIKeyMiddleware:
    """With an API key set, /v1/* needs `Authorization: Bearer <key>`; health and metrics stay open."""

    def __init__(self, app: Any, api_key: str) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and route_path(scope).startswith(_V1):
            got = dict(scope.get("headers", [])).get(b"authorization", b"")
            if not hmac.compare_digest(got, self.expected):
                return await error_response(401, "Incorrect or missing API key: send it as "
                                                 "'Authorization: Bearer <key>'",
                                            code="invalid_api_key")(scope, receive, send)
        await self.app(scope, receive, send)


def _host_name(value: bytes) -> str:
    """The host part of a Host header: 'example.com:8000' -> 'example.com', '[::1]:80' -> '::1'."""
    text = value.decode("latin-1").strip().lower()
    if text.startswith("["):
        return text[1:text.find("]")] if "]" in text else text
    return text.rsplit(":", 1)[0] if text.count(":") == 1 else text


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
        return True
    except ValueError:
        return False


def default_allowed_hosts(bind_host: str) -> list[str]:
    """The bind address and localhost; on a wildcard bind also this machine's names and any IP
    address (a DNS-rebinding page always sends a domain name, never an IP, as its Host)."""
    hosts = ["localhost", "127.0.0.1", "::1"]
    if bind_host in WILDCARD_HOSTS:
        hosts += [socket.gethostname(), socket.getfqdn(), "ip-address"]
    else:
        hosts.append(bind_host)
    return list(dict.fromkeys(h.lower() for h in hosts))


class HostCheckMiddleware:
    """Answers 400 to a request whose Host header names none of `allowed` ("*": any host;
    "ip-address": any IP literal; "*.example.com": that domain's subdomains)."""

    def __init__(self, app: Any, allowed: Iterable[str]) -> None:
        self.app = app
        self.allowed = {h.lower() for h in allowed}
        self.any = "*" in self.allowed
        self.any_ip = "ip-address" in self.allowed
        self.suffixes = tuple(h[1:] for h in self.allowed if h.startswith("*."))

    def allows(self, host: str) -> bool:
        return (self.any or host in self.allowed or (self.any_ip and _is_ip(host))
                or (bool(self.suffixes) and host.endswith(self.suffixes)))

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and not self.any:
            host = _host_name(dict(scope.get("headers", [])).get(b"host", b""))
            if not self.allows(host):
                return await error_response(
                    400, f"Host {host!r} is not allowed: start the server with --allowed-hosts "
                         f"naming it (or '*')", code="invalid_host")(scope, receive, send)
        await self.app(scope, receive, send)
