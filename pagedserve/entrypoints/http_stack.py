"""Which HTTP parser and event loop uvicorn will pick here, without importing either.

uvicorn's defaults ("auto") take httptools and uvloop when they are importable and fall back to
the pure-Python h11 parser and asyncio's own loop. Per streamed token the difference is real (on
our CPU, a replica's API server spent 44 µs per SSE event on h11 against 31 on httptools,
benchmarks/frontend_relay.py), so servers log it at start-up and benchmark results record it.
"""
from __future__ import annotations

from importlib.util import find_spec


def http_stack() -> dict[str, str]:
    return {"http": "httptools" if find_spec("httptools") else "h11",
            "loop": "uvloop" if find_spec("uvloop") else "asyncio"}


def describe() -> str:
    s = http_stack()
    note = "" if s["http"] == "httptools" else " (pip install httptools: h11 costs more per streamed token)"
    return f"HTTP parser {s['http']}, event loop {s['loop']}{note}"
