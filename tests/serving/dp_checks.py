"""Checks run against both backends' DP endpoints (test_dp_mp.py, test_dp_ray.py)."""
from __future__ import annotations

import json
import os
import signal
import threading
import time

import httpx
import pytest

from dp_helpers import API_KEY, MODEL, REPLICA_KEY, per_replica


def wait_for(pred, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = pred()
        if got:
            return got
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def check_openai_client(server, reference_v1: str) -> None:
    """The openai client against the DP endpoint; greedy text equals one replica's alone."""
    import openai
    client = openai.OpenAI(base_url=server.v1, api_key=API_KEY, max_retries=0, timeout=120)
    direct = openai.OpenAI(base_url=reference_v1, api_key=REPLICA_KEY, max_retries=0, timeout=120)
    assert [m.id for m in client.models.list().data] == [MODEL]

    kw = dict(model=MODEL, prompt="In the beginning God created", max_tokens=12, temperature=0)
    got = client.completions.create(**kw)
    ref = direct.completions.create(**kw)
    assert got.choices[0].text == ref.choices[0].text and got.usage.completion_tokens == 12

    msgs = [{"role": "user", "content": "Continue: The LORD is my shepherd"}]
    chat = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=10, temperature=0)
    ref_chat = direct.chat.completions.create(model=MODEL, messages=msgs, max_tokens=10, temperature=0)
    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model=MODEL, messages=msgs, max_tokens=10, temperature=0, stream=True) if c.choices)
    assert chat.choices[0].message.content == streamed == ref_chat.choices[0].message.content != ""

    assert httpx.get(server.base_url + "/ping").status_code == 200  # vLLM's alias of /health
    # vLLM's X-Request-Id names the response on the replica behind the front end too
    named = client.completions.create(**kw, extra_headers={"X-Request-Id": "dp-7"})
    assert named.id == "cmpl-dp-7" and named.choices[0].text == ref.choices[0].text

    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.v1, api_key="wrong", max_retries=0).models.list()
    with pytest.raises(openai.BadRequestError) as e:  # the replica's own validation, passed through
        client.completions.create(model=MODEL, prompt="x", max_tokens=-1)
    assert "max_tokens" in str(e.value)


def check_metrics_aggregate(server, http: httpx.Client) -> None:
    """Every replica's series under its `replica` label, vLLM names included; the counters
    of the requests just sent add up over the replicas."""
    name = "vllm:e2e_request_latency_seconds_count"

    def count() -> float:
        return sum(per_replica(http.get("/metrics").text, name).values())

    def quiet():  # an earlier test's requests may not be reported yet: wait until the count holds
        first = count()
        time.sleep(1.0)  # two report periods
        return (first,) if count() == first else None
    before = wait_for(quiet, 10, "the count left by earlier requests to settle")[0]
    for i in range(6):
        r = http.post("/v1/completions", json={"model": MODEL, "prompt": [50 + i] * 40,
                                               "max_tokens": 5, "ignore_eos": True})
        assert r.status_code == 200, r.text

    def settled():  # the ray replicas report their metrics every half second
        merged = http.get("/metrics").text
        return merged if sum(per_replica(merged, name).values()) == before + 6 else None
    merged = wait_for(settled, 10, "the six requests in /metrics")
    for family in ("vllm:num_requests_running", "vllm:num_requests_waiting",
                   "vllm:kv_cache_usage_perc", "vllm:prefix_cache_queries_total",
                   "vllm:prefix_cache_hits_total", "vllm:time_to_first_token_seconds_count",
                   "vllm:time_per_output_token_seconds_sum", "pagedserve:generation_tokens_total"):
        assert set(per_replica(merged, family)) == {"0", "1"}, family
    tokens = per_replica(merged, "vllm:generation_tokens_total")
    assert per_replica(merged, "pagedserve:generation_tokens_total") == tokens


# Enough requests that both replicas stay busy for seconds at once (each takes its max-num-seqs of
# 32), so that the merged /metrics (ray: replica reports every 0.5 s) shows them running on both.
N_LOAD = 32
KILL_LOAD_TOKENS = 240  # each load request's length: long enough to be mid-stream at the kill (was 480)


def check_kill_under_load(server, recovered) -> None:
    """SIGKILL one replica with requests in flight on both: in flight there, a clean 503 or
    SSE error (mp: only streams that had started; the rest are retried on the survivor and
    served); everything else is served; /health degraded until `recovered(health)`."""
    results: list[tuple[str, int, object]] = []

    def one(i: int) -> None:
        body = {"model": MODEL, "prompt": [7 + i] * 24, "max_tokens": KILL_LOAD_TOKENS, "ignore_eos": True,
                "temperature": 0, "stream": i % 2 == 0}
        with httpx.Client(base_url=server.base_url, headers=server.headers, timeout=120) as c:
            with c.stream("POST", "/v1/completions", json=body) as r:
                r.read()
                if r.status_code != 200 or not body["stream"]:
                    results.append(("json", r.status_code, r.json()))
                else:
                    events = [ln[6:] for ln in r.text.splitlines() if ln.startswith("data: ")]
                    results.append(("sse", r.status_code, events))

    threads = [threading.Thread(target=one, args=(i,)) for i in range(N_LOAD)]
    for t in threads:
        t.start()

    def busy_everywhere():
        running = per_replica(httpx.get(server.base_url + "/metrics", timeout=60).text,
                              "vllm:num_requests_running")
        # Half the load at once, not a trickle: the front end must not cap the requests in flight
        # (Ray Serve's default max_ongoing_requests, 5, on the ingress once did).
        return len(running) == 2 and all(v >= 1 for v in running.values()) and \
            sum(running.values()) >= N_LOAD // 2
    wait_for(busy_everywhere, 60, "half the requests running, on both replicas")
    victim = next(r for r in server.health()[1]["replicas"] if r["replica"] == "1")
    os.kill(victim["pid"], signal.SIGKILL)

    wait_for(lambda: server.health()[1]["status"] == "degraded", 20, "degraded /health")
    assert server.health()[0] == 200
    with httpx.Client(base_url=server.base_url, headers=server.headers, timeout=120) as c:
        for i in range(4):  # meanwhile the survivor serves new requests
            r = c.post("/v1/completions", json={"model": MODEL, "prompt": [300 + i] * 20,
                                                "max_tokens": 3})
            assert r.status_code == 200, r.text
    for t in threads:
        t.join(timeout=120)
        assert not t.is_alive(), "a request hung"

    ok = failed = 0
    for kind, status, payload in results:
        if kind == "json" and status == 200:
            ok += payload["usage"]["completion_tokens"] == KILL_LOAD_TOKENS
        elif kind == "json":
            assert status == 503 and payload["error"]["code"] == "replica_failed", payload
            failed += 1
        elif "error" in payload[-2]:
            assert payload[-1] == "[DONE]"
            assert json.loads(payload[-2])["error"]["code"] == "replica_failed"
            failed += 1
        else:
            assert payload[-1] == "[DONE]"
            ok += json.loads(payload[-2])["choices"][0]["finish_reason"] == "length"
    assert ok + failed == N_LOAD and ok >= 2 and failed >= 1, (ok, failed)

    wait_for(lambda: server.health()[1]["status"] == "ok", 240, "the replica's restart")
    assert recovered(server.health()[1], victim)
    r = httpx.post(server.v1 + "/completions", headers=server.headers, timeout=120,
                   json={"model": MODEL, "prompt": [400] * 20, "max_tokens": 3})
    assert r.status_code == 200, r.text


def check_client_disconnect_aborts_on_the_replica(server) -> None:
    """A client that leaves mid-stream frees its replica's slot: the request stops running
    there long before its 480 tokens (the engine aborted it)."""
    gen = "vllm:generation_tokens_total"

    def totals():
        m = httpx.get(server.base_url + "/metrics", timeout=60).text
        return sum(per_replica(m, gen).values()), sum(per_replica(m, "vllm:num_requests_running").values())
    before, _ = wait_for(lambda: (lambda t: t if t[1] == 0 else None)(totals()), 60, "an idle server")
    body = {"model": MODEL, "prompt": [11] * 24, "max_tokens": 480, "ignore_eos": True, "stream": True}
    with httpx.Client(base_url=server.base_url, headers=server.headers, timeout=120) as c:
        with c.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if line.startswith("data: "):
                    break  # one token, then hang up
    after, _ = wait_for(lambda: (lambda t: t if t[1] == 0 else None)(totals()), 30,
                        "the abandoned request to stop running")
    time.sleep(1.0)  # the ray replicas report every half second
    generated = totals()[0] - before
    print(f"\ntokens generated for the abandoned request: {generated:.0f} of 480")
    assert generated < 480


def mp_replica_recovered(health: dict, victim: dict) -> bool:
    """check_kill_under_load's `recovered` for the mp backend: the victim's replica restarted
    once, under a new pid, and answers /health."""
    r = next(r for r in health["replicas"] if r["replica"] == victim["replica"])
    return r["restarts"] == 1 and r["pid"] != victim["pid"] and \
        httpx.get(r["url"] + "/health").status_code == 200
