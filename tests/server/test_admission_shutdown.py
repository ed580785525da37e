"""Admission control and graceful shutdown on one small server of its own (tiny model, 4
sequences at once, a waiting queue of 36, --shutdown-timeout 2):

- past max_num_seqs + --max-waiting-requests in flight, requests answer 503 with Retry-After,
  counted in /metrics, and the engine's queue never grows past the limit;
- SIGTERM with 20 streams and 20 plain requests in flight: every stream ends with [DONE] (after
  an error event if it was cut), every other client gets JSON, the log has no traceback, and
  the process exits within the timeout plus 2 s. (Last: it stops the server.)
"""
from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import threading

import httpx
import pytest

from server_process import BLOCK_SIZE, MAX_MODEL_LEN, NUM_BLOCKS, start_server, stop_server

MAX_NUM_SEQS = 4
MAX_WAITING = 36
LIMIT = MAX_NUM_SEQS + MAX_WAITING
SHUTDOWN_TIMEOUT_S = 2.0


@pytest.fixture(scope="module")
def small(tiny_model_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("small") / "server.log"
    s = start_server(tiny_model_dir("llama"), log, "--max-model-len", str(MAX_MODEL_LEN),
                     "--block-size", str(BLOCK_SIZE), "--num-gpu-blocks-override", str(NUM_BLOCKS),
                     "--max-num-seqs", str(MAX_NUM_SEQS), "--max-waiting-requests", str(MAX_WAITING),
                     "--shutdown-timeout", str(SHUTDOWN_TIMEOUT_S), "--swap-space", "0.05")
    yield s
    stop_server(s)


def _gauges(server) -> dict[str, float]:
    m = server.metrics()
    return {k: m.get(k, 0.0) for k in ("vllm:num_requests_running", "vllm:num_requests_waiting")}


def _long(i: int, stream: bool) -> dict:
    return {"model": "tiny", "prompt": [10 + i % 50] * 8, "max_tokens": 480, "ignore_eos": True,
            "stream": stream}


def test_past_the_waiting_limit_requests_get_503_with_retry_after(small):
    n = LIMIT + 20
    results: list[tuple[int, dict, str]] = []
    peak_waiting = 0.0

    async def go():
        nonlocal peak_waiting
        release = asyncio.Event()
        async with httpx.AsyncClient(base_url=small.base_url, timeout=60,
                                     limits=httpx.Limits(max_connections=n + 10)) as c:
            async def one(i):
                async with c.stream("POST", "/v1/completions", json=_long(i, True)) as r:
                    body = (await r.aread()).decode() if r.status_code != 200 else ""
                    results.append((r.status_code, dict(r.headers), body))
                    if r.status_code == 200:
                        await release.wait()  # hold the stream open until every answer is in
            tasks = [asyncio.ensure_future(one(i)) for i in range(n)]
            while len(results) < n:
                await asyncio.sleep(0.1)
                peak_waiting = max(peak_waiting, _gauges(small)["vllm:num_requests_waiting"])
            release.set()
            await asyncio.gather(*tasks)
    asyncio.run(go())

    ok = [r for r in results if r[0] == 200]
    rejected = [r for r in results if r[0] != 200]
    assert len(ok) == LIMIT and len(rejected) == n - LIMIT, [r[0] for r in results]
    for status, headers, body in rejected:
        assert status == 503 and headers.get("retry-after") == "1", (status, headers)
        assert json.loads(body)["error"]["code"] == "server_overloaded"
    assert peak_waiting <= MAX_WAITING
    text = httpx.get(small.base_url + "/metrics").text
    assert f'pagedserve:rejected_requests_total{{reason="queue_full"}} {float(n - LIMIT)}' in text


def test_sigterm_under_load_ends_every_request_cleanly(small):
    results: list[tuple[str, int, str]] = []

    def one(i: int) -> None:
        stream = i % 2 == 0
        try:
            with httpx.Client(base_url=small.base_url, timeout=60) as c:
                with c.stream("POST", "/v1/completions", json=_long(i, stream)) as r:
                    results.append(("sse" if stream and r.status_code == 200 else "json", r.status_code,
                                    r.read().decode()))
        except httpx.HTTPError as e:
            results.append(("dropped", 0, repr(e)))

    def all_in() -> bool:
        g = _gauges(small)
        return g["vllm:num_requests_running"] + g["vllm:num_requests_waiting"] == 40

    threads = [threading.Thread(target=one, args=(i,)) for i in range(40)]
    for t in threads:
        t.start()
    for _ in range(600):
        if all_in():
            break
        threading.Event().wait(0.1)
    assert all_in(), _gauges(small)
    small.proc.send_signal(signal.SIGTERM)
    try:
        small.proc.wait(timeout=SHUTDOWN_TIMEOUT_S + 2.0 + 3.0)  # (3 s: the CI machine's slack)
    except subprocess.TimeoutExpired:
        pytest.fail("the server did not exit after the shutdown timeout:\n" + small.log())
    for t in threads:
        t.join(30)
    assert len(results) == 40
    for kind, status, body in results:
        assert kind != "dropped", body
        if kind == "sse":
            events = [ln[6:] for ln in body.splitlines() if ln.startswith("data: ")]
            assert events[-1] == "[DONE]", events[-3:]
            if "error" in events[-2]:
                assert json.loads(events[-2])["error"]["code"] == "server_shutting_down"
        else:
            err = json.loads(body)
            assert status == 200 or (status == 503 and err["error"]["code"] == "server_shutting_down"), body
    log = small.log_path.read_text(errors="replace")
    assert "Traceback" not in log, log[-3000:]
    assert "shutdown timeout" in log
