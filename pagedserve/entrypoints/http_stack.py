"""Which HTTP parser and event loop uvicorn will pick here, without importing either.

uvicorn's defaults ("auto") take httptools and uvloop when they are importable and fall back to
the pure-Python h11 parser and asyncio's own loop. Per streamed token the difference is real (on
our CPU, an API server spent 42-46 µs of CPU per SSE event on h11 against 35-38 on httptools,
the DP front end 25-29 against 22-27: benchmarks/results/cpu/frontend_relay_{h11,httptools}*.json),
so servers log it at start-up and benchmark results record it.
"""
from __future__ import annotations

from importlib.util import find_spec

# Our servers (uvicorn's timeout_keep_alive; vLLM's and uvicorn's default too) close a connection
# idle this long. A client that keeps idle connections as long may send a request down one just
# as the server closes it, and reads "connection reset": our HTTP clients drop theirs sooner.
SERVER_KEEP_ALIVE_S = 5
CLIENT_KEEP_ALIVE_S = 3.0


def http_stack() -> dict[str, str]:
    return {"http": "httptools" if find_spec("httptools") else "h11",
            "loop": "uvloop" if find_spec("uvloop") else "asyncio"}


def describe() -> str:
    s = http_stack()
    note = "" if s["http"] == "httptools" else " (pip install httptools: h11 costs more per streamed token)"
    return f"HTTP parser {s['http']}, event loop {s['loop']}{note}"
