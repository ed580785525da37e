"""Call an ASGI app in-process with one buffered request body and stream its answer back.

The ray backend's replicas host the ordinary pagedserve OpenAI app and serve it through
a Ray handle rather than a socket; this is the adapter. Yields ("start", status,
content_type) once, then body chunks. Closing the generator early tells the app the client
disconnected (so the engine aborts the request and frees its KV blocks).
"""
from __future__ import annotations

import asyncio
from typing import Any, AsyncIterator


async def call_asgi(app: Any, method: str, path: str, body: bytes) -> AsyncIterator[Any]:
    messages: asyncio.Queue = asyncio.Queue()
    disconnected = asyncio.Event()
    delivered = False

    async def receive() -> dict:
        nonlocal delivered
        if not delivered:
            delivered = True
            return {"type": "http.request", "body": body, "more_body": False}
        await disconnected.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        await messages.put(message)

    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1",
             "method": method, "scheme": "http", "path": path, "raw_path": path.encode(),
             "query_string": b"", "root_path": "", "client": ("127.0.0.1", 0),
             "server": ("127.0.0.1", 0),
             "headers": [(b"content-type", b"application/json"),
                         (b"content-length", str(len(body)).encode())]}
    task = asyncio.get_running_loop().create_task(app(scope, receive, send))
    try:
        while True:
            get = asyncio.ensure_future(messages.get())
            await asyncio.wait({get, task}, return_when=asyncio.FIRST_COMPLETED)
            if not get.done():
                get.cancel()
                if messages.empty():
                    task.result()  # the app returned without a complete answer: raise its error
                    raise RuntimeError(f"{method} {path}: the app ended without a response")
                continue
            message = get.result()
            if message["type"] == "http.response.start":
                headers = {k.lower(): v for k, v in message.get("headers", [])}
                yield ("start", message["status"],
                       headers.get(b"content-type", b"application/json").decode())
            elif message["type"] == "http.response.body":
                if message.get("body"):
                    yield message["body"]
                if not message.get("more_body", False):
                    return
    finally:
        disconnected.set()
        if not task.done():
            task.cancel()
