"""200 concurrent streams through the two-process server: nothing lost, memory bounded.

Each stream is seeded, so its tokens do not depend on what else is in the batch: a second wave
of the same 200 requests must stream exactly the same text, and every stream must deliver all
of its max_tokens. The API server's RSS after the second wave must not have grown beyond a
generous margin (per-request state is dropped when a request ends).
"""
from __future__ import annotations

import asyncio
import json
from pathlib import Path

import httpx

N_STREAMS = 200
MAX_TOKENS = 6
RSS_GROWTH_LIMIT = 24 << 20   # bytes; a leak of per-request state across 200 streams shows up above


def _rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


async def _stream(client: httpx.AsyncClient, model: str, i: int) -> tuple[str, int, str | None]:
    body = {"model": model, "prompt": f"stream {i} of many", "max_tokens": MAX_TOKENS,
            "temperature": 1.0, "seed": i, "logprobs": 0, "ignore_eos": True, "stream": True}
    text, tokens, finish = [], 0, None
    async with client.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            assert "error" not in chunk, chunk
            for c in chunk["choices"]:
                text.append(c["text"])
                tokens += len(c["logprobs"]["tokens"])
                finish = c["finish_reason"] or finish
    return "".join(text), tokens, finish


async def _wave(server) -> list[tuple[str, int, str | None]]:
    limits = httpx.Limits(max_connections=N_STREAMS, max_keepalive_connections=N_STREAMS)
    async with httpx.AsyncClient(base_url=server.base_url, headers=server.headers, timeout=300,
                                 limits=limits) as client:
        return await asyncio.gather(*(_stream(client, server.model, i) for i in range(N_STREAMS)))


def test_200_concurrent_streams_lose_nothing_and_memory_stays_bounded(server):
    pid = server.proc.pid
    first = asyncio.run(_wave(server))
    assert all(tokens == MAX_TOKENS and finish == "length" for _, tokens, finish in first), \
        [r for r in first if r[1] != MAX_TOKENS or r[2] != "length"][:3]
    rss_after_first = _rss(pid)
    second = asyncio.run(_wave(server))
    assert second == first  # seeded: the same streams, token for token
    growth = _rss(pid) - rss_after_first
    assert growth < RSS_GROWTH_LIMIT, f"API server RSS grew {growth >> 20} MiB over 200 more streams"
    m = server.metrics()
    assert m["pagedserve:num_requests_running"] == 0
    assert m["pagedserve:kv_cache_usage_perc"] == 0
