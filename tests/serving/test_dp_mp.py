"""`pagedserve serve --data-parallel-size 2` (mp backend) on the demo model: routing
affinity and balance, metric aggregation, the openai client, a replica killed under load (it
restarts a replica), the hardening of issue #38, and (last: it stops the server) SIGTERM."""
from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import threading

import httpx

from dp_checks import (check_client_disconnect_aborts_on_the_replica, check_kill_under_load,
                       check_metrics_aggregate, check_openai_client, mp_replica_recovered, wait_for)
from dp_helpers import (API_KEY, BLOCK_SIZE, MODEL, REPLICA_HEADERS, REPLICA_KEY, arun_workload, per_replica,
                        replica_figures, run_workload, shared_prefix_workload)

from pagedserve.serving.frontend import build_dp_app
from pagedserve.serving.mp_pool import ProcessReplicaPool
from pagedserve.serving.routing import RoundRobinPolicy


def _replica_urls(server) -> list[str]:
    return [r["url"] for r in server.health()[1]["replicas"]]


def _metrics(url: str) -> str:
    return httpx.get(url + "/metrics", timeout=10).text


def _round_robin_run(urls: list[str], prompts: list[list[int]]) -> None:
    """The same front end over the same replicas, with the round-robin policy."""
    from transformers import AutoTokenizer

    from pagedserve.demo_model import DEMO_MODEL_DIR

    async def go():
        pool = ProcessReplicaPool.attach(urls, RoundRobinPolicy(), replica_key=REPLICA_KEY)
        await pool.start()
        app = build_dp_app(pool, AutoTokenizer.from_pretrained(str(DEMO_MODEL_DIR)), BLOCK_SIZE,
                           manage_pool=False)
        try:
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://dp",
                                         timeout=120) as c:
                await arun_workload(c, prompts)
        finally:
            await pool.stop()
    asyncio.run(go())


def test_prefix_routing_keeps_one_replicas_hit_rate_and_balances(mp_server):
    urls = _replica_urls(mp_server)
    # One replica alone (the baseline), then DP=2 with prefix routing, then round-robin;
    # each run has its own prefixes, so no run finds another's blocks cached.
    before = [_metrics(urls[0])]
    run_workload(urls[0], shared_prefix_workload(seed=1), headers=REPLICA_HEADERS)
    single = replica_figures(before, [_metrics(urls[0])])

    before = [_metrics(mp_server.base_url)]
    run_workload(mp_server.base_url, shared_prefix_workload(seed=2), headers=mp_server.headers)
    prefix = replica_figures(before, [_metrics(mp_server.base_url)])

    before = [_metrics(u) for u in urls]
    _round_robin_run(urls, shared_prefix_workload(seed=3))
    rr = replica_figures(before, [_metrics(u) for u in urls])

    print("\nDP routing figures (mp):", json.dumps(
        {"one_replica": single, "dp2_prefix": prefix, "dp2_round_robin": rr}))
    assert single["requests"] == prefix["requests"] == rr["requests"] == 48
    assert single["hit_rate"] > 0.5  # the workload does share prefixes
    assert abs(prefix["hit_rate"] - single["hit_rate"]) <= 0.05
    assert len(prefix["shares"]) == 2 and min(prefix["shares"].values()) >= 0.30


def test_metrics_aggregate_every_replica_with_a_label(mp_server, mp_http):
    check_metrics_aggregate(mp_server, mp_http)
    # the labelled values are each replica's own
    merged = mp_http.get("/metrics").text
    from dp_helpers import per_replica
    for i, url in enumerate(_replica_urls(mp_server)):
        own = per_replica(_metrics(url), "vllm:prefix_cache_queries_total")[""]
        assert per_replica(merged, "vllm:prefix_cache_queries_total")[str(i)] == own
    routed = per_replica(merged, "pagedserve:router_routed_requests_total")
    assert set(routed) == {"0", "1"}


def test_openai_client_against_the_dp_endpoint(mp_server):
    check_openai_client(mp_server, _replica_urls(mp_server)[1] + "/v1")


def test_client_disconnect_aborts_on_the_replica(mp_server):
    check_client_disconnect_aborts_on_the_replica(mp_server)


# ---- hardening (issue #38) ------------------------------------------------------------------

def _engine_cores_of(pid: int) -> list[int]:
    """pids of the engine-core processes started by the process pid."""
    out = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                ppid = int(open(f"/proc/{d}/stat").read().rsplit(")", 1)[1].split()[1])
                cmd = open(f"/proc/{d}/cmdline", "rb").read()
            except (OSError, IndexError, ValueError):
                continue
            if ppid == pid and b"pagedserve.engine.core" in cmd:
                out.append(int(d))
    return out


def _busy(server) -> float:
    m = httpx.get(server.base_url + "/metrics", timeout=60).text
    return sum(per_replica(m, "vllm:num_requests_running").values()) + \
        sum(per_replica(m, "vllm:num_requests_waiting").values())


def test_dropped_non_streaming_requests_are_cancelled_on_the_replicas(mp_server):
    """30 plain requests whose clients hang up right after sending: the front end notices and the
    replicas abort them (before the fix they ran all their 480 tokens)."""
    wait_for(lambda: _busy(mp_server) == 0, 60, "an idle server")
    gen = "vllm:generation_tokens_total"
    before = sum(per_replica(httpx.get(mp_server.base_url + "/metrics").text, gen).values())
    host, port = mp_server.base_url.removeprefix("http://").split(":")
    socks = []
    for i in range(30):
        body = json.dumps({"model": MODEL, "prompt": [20 + i] * 16, "max_tokens": 480,
                           "ignore_eos": True}).encode()
        s = socket.create_connection((host, int(port)), timeout=10)
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                  b"Authorization: Bearer " + API_KEY.encode() + b"\r\nContent-Type: application/json\r\n"
                  b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        socks.append(s)
    wait_for(lambda: _busy(mp_server) >= 20, 30, "the requests to reach the replicas")
    for s in socks:
        s.close()
    wait_for(lambda: _busy(mp_server) == 0, 20, "the dropped requests to be aborted")
    generated = sum(per_replica(httpx.get(mp_server.base_url + "/metrics").text, gen).values()) - before
    assert generated < 30 * 480 / 4, generated


def test_public_health_hides_the_replicas_and_replicas_need_their_key(mp_server):
    r = httpx.get(mp_server.base_url + "/health", timeout=30)
    assert r.status_code == 200 and r.json() == {"status": "ok"}
    urls = _replica_urls(mp_server)  # with the key: the details
    assert len(urls) == 2
    for url in urls:
        assert httpx.get(url + "/v1/models", timeout=30).status_code == 401
        assert httpx.get(url + "/kv_cache/state", timeout=30).status_code == 401
        assert httpx.get(url + "/v1/models", headers=REPLICA_HEADERS, timeout=30).status_code == 200


def test_front_end_validates_before_routing_and_answers_openai_errors(mp_http):
    for prompt in ([2**63], [2**64 + 5], [-1], ["a", 1], [True, False]):
        r = mp_http.post("/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 2})
        assert r.status_code == 400, (prompt, r.text)
        assert r.json()["error"]["param"] == "prompt" and r.json()["error"]["type"] == "invalid_request_error"
    r = mp_http.post("/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": "16"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens", r.text
    for method, path in (("GET", "/v1/nope"), ("POST", "/v1/embeddings"), ("DELETE", "/v1/models"),
                         ("GET", "/v1/models/..%2f..%2fkv_cache/state"), ("GET", "/v1/..%2fmetrics"),
                         ("GET", "/v1/models/..%2f..%2fopenapi.json"), ("GET", "/v1/..%2fdashboard/config")):
        r = mp_http.request(method, path, **({"json": {}} if method == "POST" else {}))
        assert r.status_code in (404, 405), (path, r.status_code, r.text)
        assert set(r.json()) == {"error"} and r.json()["error"]["message"], (path, r.text)


def test_tokenize_detokenize_and_version_are_relayed(mp_http):
    """vLLM's extras reach a replica (any: no routing key) and answer as the demo model's tokenizer."""
    from transformers import AutoTokenizer

    from pagedserve import __version__
    from pagedserve.demo_model import DEMO_MODEL_DIR
    tok = AutoTokenizer.from_pretrained(str(DEMO_MODEL_DIR))
    text = "In the beginning God created the heaven and the earth."
    r = mp_http.post("/tokenize", json={"model": MODEL, "prompt": text})
    assert r.status_code == 200 and r.json()["tokens"] == tok(text).input_ids, r.text
    assert mp_http.post("/detokenize", json={"tokens": tok(text).input_ids}).json() == \
        {"prompt": tok.decode(tok(text).input_ids)}
    r = mp_http.post("/tokenize", json={"messages": [{"role": "user", "content": text}]})
    assert r.json()["tokens"] == tok(tok.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                                             add_generation_prompt=True), add_special_tokens=False).input_ids
    assert mp_http.get("/version").json() == {"version": __version__}


def test_killing_a_replica_under_load(mp_server):
    check_kill_under_load(mp_server, mp_replica_recovered)


def test_a_replica_whose_core_died_is_routed_around(mp_server):
    """kill -9 one replica's engine core: its API server answers 503 for a few seconds before it
    exits; the front end takes it out of routing at once and sends those requests to the other."""
    wait_for(lambda: _busy(mp_server) == 0, 60, "an idle server")
    victim = next(r for r in mp_server.health()[1]["replicas"] if r["replica"] == "0")
    cores = _engine_cores_of(victim["pid"])
    assert cores, "the replica's engine core process"
    for pid in cores:
        os.kill(pid, signal.SIGKILL)
    statuses = []
    with httpx.Client(base_url=mp_server.base_url, headers=mp_server.headers, timeout=120) as c:
        for i in range(40):
            r = c.post("/v1/completions", json={"model": MODEL, "prompt": [500 + i] * 20, "max_tokens": 2})
            statuses.append((r.status_code, r.text[:200]))
    assert all(code == 200 for code, _ in statuses), [s for s in statuses if s[0] != 200][:3]
    h = mp_server.health()[1]
    assert h["status"] == "degraded"  # (it restarts meanwhile: not awaited)
    # Nothing was served there after the kill: its one 503 took it out of routing.
    assert next(r for r in h["replicas"] if r["replica"] == "0")["routed"] == victim["routed"]


def test_sigterm_ends_the_front_end_and_its_requests_cleanly(mp_server):
    """Last (it stops the server): SIGTERM with 10 streams and 10 plain requests in flight; after
    --shutdown-timeout (3 s here) each ends cleanly ([DONE] after an error event, or 503 JSON) and
    the front end and its replicas exit, with no traceback in the log."""
    wait_for(lambda: _busy(mp_server) == 0, 60, "an idle server")
    results: list[tuple[str, int, str]] = []

    def one(i: int) -> None:
        stream = i % 2 == 0
        body = {"model": MODEL, "prompt": [60 + i] * 16, "max_tokens": 480, "ignore_eos": True, "stream": stream}
        try:
            with httpx.Client(base_url=mp_server.base_url, headers=mp_server.headers, timeout=120) as c:
                with c.stream("POST", "/v1/completions", json=body) as r:
                    results.append(("sse" if stream and r.status_code == 200 else "json", r.status_code,
                                    r.read().decode()))
        except httpx.HTTPError as e:
            results.append(("dropped", 0, repr(e)))

    threads = [threading.Thread(target=one, args=(i,)) for i in range(20)]
    for t in threads:
        t.start()
    wait_for(lambda: _busy(mp_server) == 20, 60, "the 20 requests running")
    replicas = [r["pid"] for r in mp_server.health()[1]["replicas"]]
    mp_server.proc.send_signal(signal.SIGTERM)
    mp_server.proc.wait(timeout=3 + 2 + 15)  # (15 s: the replicas' own exit, on a loaded CI machine)
    for t in threads:
        t.join(30)
    assert len(results) == 20
    for kind, status, body in results:
        assert kind != "dropped", body
        if kind == "sse":
            events = [ln[6:] for ln in body.splitlines() if ln.startswith("data: ")]
            assert events[-1] == "[DONE]", events[-3:]
        else:
            assert status in (200, 503) and json.loads(body), body
    for pid in replicas:
        wait_for(lambda: not os.path.exists(f"/proc/{pid}") or
                 open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] == "Z", 20, "the replicas' exit")
    log = mp_server.log_path.read_text(errors="replace")
    assert "Traceback" not in log, log[-4000:]
