"""The mp pool's relay, with each of its HTTP clients (aiohttp, httpx), against small fake
replicas (no engine): streams pass through byte for byte, a refused connection goes to the
other replica, a stream whose replica is lost before its first byte continues from another
one, a replica lost mid-stream ends the stream with the replica_failed event, a client that
leaves closes the replica's connection, and a live replica whose /health stops answering 200 is
taken out of routing and back in once it answers."""
from __future__ import annotations

import asyncio
import json
import socket
import threading
import time

import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from pagedserve.serving.mp_pool import ProcessReplicaPool
from pagedserve.serving.pool import NoReplicaAvailable
from pagedserve.serving.relay_clients import RELAY_CLIENTS, aiohttp
from pagedserve.serving.routing import RoundRobinPolicy

EVENTS = [f'data: {{"choices":[{{"index":0,"text":"t{i}"}}]}}\n\n' for i in range(50)]
DONE = "data: [DONE]\n\n"


def _fake_app(state: dict) -> FastAPI:
    app = FastAPI()

    @app.get("/health")
    async def health():
        if state["health"] == "hang":  # longer than the tests' check timeout, short for teardown
            await asyncio.sleep(2)
        return JSONResponse({}, status_code=503 if state["health"] == "503" else 200)

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = json.loads(await request.body())
        state["bodies"].append(body)
        if not body.get("stream"):
            return JSONResponse({"echo": body})

        async def stream():
            try:
                if state["dies"] < body.get("die_first_attempts", 0):
                    state["dies"] += 1
                    raise RuntimeError("replica lost before its first byte")
                for i, e in enumerate(EVENTS):
                    if body.get("die_after") == i:
                        raise RuntimeError("replica lost")  # uvicorn drops the connection
                    await asyncio.sleep(body.get("delay", 0))
                    yield e
                yield DONE
            except asyncio.CancelledError:
                state["cancelled"] += 1
                raise
            finally:
                state["finished"] += 1
        return StreamingResponse(stream(), media_type="text/event-stream")
    return app


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def fake_replica():
    state = {"bodies": [], "cancelled": 0, "finished": 0, "dies": 0, "health": "ok"}
    port = _free_port()
    server = uvicorn.Server(uvicorn.Config(_fake_app(state), host="127.0.0.1", port=port,
                                           log_level="critical"))
    t = threading.Thread(target=server.run, daemon=True)
    t.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline, "fake replica did not start"
        time.sleep(0.05)
    yield f"http://127.0.0.1:{port}", state
    server.should_exit = True
    t.join(10)


def _clients() -> list[str]:
    return [c for c in RELAY_CLIENTS if c != "aiohttp" or aiohttp is not None]


async def _pool(urls: list[str], client: str) -> ProcessReplicaPool:
    pool = ProcessReplicaPool.attach(urls, RoundRobinPolicy(), relay_client=client,
                                     poll_interval=0.05)
    await pool.start()
    return pool


async def _read(resp) -> bytes:
    return b"".join([c async for c in resp.chunks])


@pytest.mark.parametrize("client", _clients())
def test_relay_passes_streams_and_bodies_through(fake_replica, client):
    url, _ = fake_replica

    async def go():
        pool = await _pool([url], client)
        try:
            body = json.dumps({"prompt": [1, 2], "stream": True}).encode()
            resp = await pool.forward("POST", "/v1/completions", body, [])
            assert resp.status == 200 and resp.content_type.startswith("text/event-stream")
            assert (await _read(resp)).decode() == "".join(EVENTS) + DONE
            resp = await pool.forward("POST", "/v1/completions", b'{"x": 1}', [])
            assert resp.status == 200 and json.loads(await _read(resp)) == {"echo": {"x": 1}}
            assert [r.in_flight for r in pool.replicas] == [0]
        finally:
            await pool.stop()
    asyncio.run(go())


@pytest.mark.parametrize("client", _clients())
def test_relay_sends_a_refused_request_to_the_other_replica(fake_replica, client):
    url, state = fake_replica
    dead = f"http://127.0.0.1:{_free_port()}"  # nothing listens there

    async def go():
        pool = ProcessReplicaPool.attach([dead, url], RoundRobinPolicy(), relay_client=client)
        await _open(pool)  # both live, as if the first had died after start-up
        try:
            n = len(state["bodies"])
            resp = await pool.forward("POST", "/v1/completions", b'{"stream": true}', [])
            assert (await _read(resp)).decode().endswith(DONE)
            assert len(state["bodies"]) == n + 1
            assert not pool.replicas[0].live and pool.replicas[1].live
            assert "connect failed" in pool.replicas[0].failures[0]
        finally:
            await pool.stop()
    asyncio.run(go())


async def _open(pool: ProcessReplicaPool) -> None:
    """pool.start() with every replica taken as healthy (no probe)."""
    async def healthy(r):
        return True
    pool._probe = healthy
    await pool.start()
    del pool._probe


@pytest.mark.parametrize("client", _clients())
def test_relay_ends_a_stream_cleanly_when_its_replica_is_lost(fake_replica, client):
    url, _ = fake_replica

    async def go():
        pool = await _pool([url], client)
        try:
            body = json.dumps({"stream": True, "die_after": 5}).encode()
            resp = await pool.forward("POST", "/v1/completions", body, [])
            text = (await _read(resp)).decode()
            assert text.startswith("".join(EVENTS[:5]))
            assert '"code": "replica_failed"' in text and text.endswith(DONE)
            assert pool.replicas[0].in_flight == 0
        finally:
            await pool.stop()
    asyncio.run(go())


@pytest.mark.parametrize("client", _clients())
def test_a_stream_lost_before_its_first_byte_continues_on_another_replica(fake_replica, client):
    url, state = fake_replica

    async def go():
        pool = await _pool([url, url], client)  # two "replicas" (the same server: it dies once)
        try:
            state["dies"] = 0
            body = json.dumps({"stream": True, "die_first_attempts": 1}).encode()
            resp = await pool.forward("POST", "/v1/completions", body, [])
            text = (await _read(resp)).decode()
            assert text == "".join(EVENTS) + DONE
            assert state["dies"] == 1
            assert sum(r.routed for r in pool.replicas) == 2 and all(r.routed == 1 for r in pool.replicas)
            assert [r.in_flight for r in pool.replicas] == [0, 0]
        finally:
            await pool.stop()
    asyncio.run(go())


@pytest.mark.parametrize("client", _clients())
def test_relay_closes_the_replica_connection_when_the_client_leaves(fake_replica, client):
    url, state = fake_replica

    async def go():
        pool = await _pool([url], client)
        try:
            before = state["cancelled"]
            body = json.dumps({"stream": True, "delay": 0.05}).encode()
            resp = await pool.forward("POST", "/v1/completions", body, [])
            first = await resp.chunks.__anext__()
            assert first.startswith(b"data: ")
            await resp.chunks.aclose()  # what StreamingResponse does when its client leaves
            deadline = time.monotonic() + 10
            while state["cancelled"] == before:
                assert time.monotonic() < deadline, "the replica never saw the client leave"
                await asyncio.sleep(0.05)
            assert pool.replicas[0].in_flight == 0
        finally:
            await pool.stop()
    asyncio.run(go())


def test_live_replica_check_marks_down_only_after_misses_in_a_row(monkeypatch):
    """_check_live: a miss, then a 200, resets the count; health_check_failures misses in a row
    mark the replica down (its prefixes forgotten), named in its failures."""
    async def go():
        pool = ProcessReplicaPool.attach(["http://127.0.0.1:1"], RoundRobinPolicy(), health_check_failures=3)
        answers = iter([False, False, True, False, False, False])

        async def probe(r, timeout=2.0):
            assert timeout == pool.health_check_timeout
            return next(answers)
        monkeypatch.setattr(pool, "_probe", probe)
        forgot = []
        monkeypatch.setattr(pool.policy, "forget", forgot.append)
        r = pool.replicas[0]
        r.live = True
        seen = []
        for _ in range(6):
            r.next_check_at = 0.0  # due now
            pool._check_live(r)
            await r.check
            seen.append((r.live, r.missed_checks))
        assert seen == [(True, 1), (True, 2), (True, 0), (True, 1), (True, 2), (False, 0)]
        assert forgot == [0] and r.failures == ["/health: no 200 within 5 s, 3 checks in a row"]
        pool._check_live(r)  # not due (next_check_at is a period ahead): no check started
        assert r.check is None
    asyncio.run(go())


@pytest.mark.parametrize("mode", ["hang", "503"])
def test_a_replica_whose_health_stops_answering_leaves_routing_and_comes_back(fake_replica, mode):
    """The supervisor checks live replicas too: a /health that hangs past the timeout or answers
    503 takes the replica out of routing (a request then gets NoReplicaAvailable, not a hang) and
    a 200 again puts it back."""
    url, state = fake_replica

    async def until(cond, what):
        deadline = time.monotonic() + 20
        while not cond():
            assert time.monotonic() < deadline, what
            await asyncio.sleep(0.05)

    async def go():
        pool = ProcessReplicaPool.attach([url], RoundRobinPolicy(), poll_interval=0.05, health_check_period=0.1,
                                         health_check_timeout=0.5, health_check_failures=2)
        await pool.start()
        r = pool.replicas[0]
        try:
            state["health"] = mode
            await until(lambda: not r.live, "the replica was never marked down")
            assert r.failures == ["/health: no 200 within 0.5 s, 2 checks in a row"]
            with pytest.raises(NoReplicaAvailable):
                await pool.forward("POST", "/v1/completions", b'{"x": 1}', [])
            state["health"] = "ok"
            await until(lambda: r.live, "the replica never came back")
            resp = await pool.forward("POST", "/v1/completions", b'{"x": 1}', [])
            assert resp.status == 200 and json.loads(await _read(resp)) == {"echo": {"x": 1}}
        finally:
            state["health"] = "ok"
            await pool.stop()
    asyncio.run(go())


def test_health_check_settings_are_checked():
    for bad in ({"health_check_period": 0}, {"health_check_timeout": -1}, {"health_check_failures": 0}):
        with pytest.raises(ValueError, match="health_check"):
            ProcessReplicaPool([], RoundRobinPolicy(), **bad)
