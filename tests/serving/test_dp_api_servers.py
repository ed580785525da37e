"""`--data-parallel-size 2 --api-server-count 3` (mp backend): three front-end processes on one
port, routing in the first. Requests from many connections spread over the three, prefix
affinity and balance hold as with one front end, /health and /metrics answer the same from any
of them, and a relay worker that dies is replaced while the others keep serving."""
from __future__ import annotations

import os
import signal
import time

import httpx
import pytest

from dp_checks import check_kill_under_load, check_openai_client, mp_replica_recovered
from dp_helpers import (MODEL, REPLICA_HEADERS, per_replica, replica_figures, run_workload, shared_prefix_workload,
                        start_dp_server, stop_process)

# A fresh connection per request, so the kernel's SO_REUSEPORT choice is made for every request.
CLOSE = {"Connection": "close"}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = start_dp_server(tmp_path_factory.mktemp("dp") / "api3.log", "--api-server-count", "3")
    yield s
    stop_process(s.proc)


def _relay_workers(server) -> list[int]:
    """pids of the front end's relay worker processes."""
    out = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            cmd = open(f"/proc/{pid}/cmdline", "rb").read().split(b"\0")
            ppid = int(open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[1])
        except OSError:
            continue
        if ppid == server.proc.pid and b"pagedserve.serving.relay_worker" in cmd:
            out.append(int(pid))
    return sorted(out)


def _listening_socket_inodes(port: int) -> set[int]:
    """Inodes of the TCP sockets listening on port (state 0A in /proc/net/tcp{,6})."""
    out = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            rows = open(table).read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            f = row.split()
            if f[3] == "0A" and int(f[1].rsplit(":", 1)[1], 16) == port:
                out.add(int(f[9]))
    return out


def _socket_inodes(pid: int) -> set[int]:
    out = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:["):
            out.add(int(link[len("socket:["):-1]))
    return out


def _replica_urls(server) -> list[str]:
    return [r["url"] for r in server.health()[1]["replicas"]]


def _metrics(url: str, headers: dict | None = None) -> str:
    return httpx.get(url + "/metrics", headers={**(headers or {}), **CLOSE}, timeout=30).text


def _wait_listening(server, want: list[str], timeout: float = 60.0) -> list[str]:
    """api_servers_listening once it is `want`, or as it stands at the deadline. /health turns ok
    when the replicas are up; a relay worker may register a moment later (on a loaded CI host
    one did), and until it listens the kernel hands it no connection."""
    deadline = time.monotonic() + timeout
    while True:
        got = server.health()[1]["api_servers_listening"]
        if got == want or time.monotonic() > deadline:
            return got
        time.sleep(0.2)


def test_requests_spread_over_the_front_ends_with_one_router(server):
    assert len(_relay_workers(server)) == 2
    assert _wait_listening(server, ["0", "1", "2"]) == ["0", "1", "2"]
    urls = _replica_urls(server)
    before = [_metrics(urls[0])]
    run_workload(urls[0], shared_prefix_workload(seed=11), headers={**REPLICA_HEADERS, **CLOSE})
    single = replica_figures(before, [_metrics(urls[0])])

    picks_before = server.health()[1]["routed_by_api_server"]
    before = [_metrics(server.base_url, server.headers)]
    run_workload(server.base_url, shared_prefix_workload(seed=12), headers={**server.headers, **CLOSE},
                 concurrency=4)
    three = replica_figures(before, [_metrics(server.base_url, server.headers)])
    picks = server.health()[1]["routed_by_api_server"]
    served = {k: v - picks_before.get(k, 0) for k, v in picks.items()}
    print("\nDP=2 behind 3 front-end processes:", single, three, served)
    assert sum(served.values()) == three["requests"] == 48
    assert sum(1 for v in served.values() if v > 0) >= 2  # more than one process relayed
    assert abs(three["hit_rate"] - single["hit_rate"]) <= 0.05  # the one router kept the affinity
    assert len(three["shares"]) == 2 and min(three["shares"].values()) >= 0.30


def test_health_and_metrics_agree_from_every_front_end(server):
    seen = set()
    for _ in range(12):
        r = httpx.get(server.base_url + "/health", headers={**server.headers, **CLOSE}, timeout=30)
        assert r.status_code == 200 and r.json()["status"] == "ok"
        seen.add(tuple(x["url"] for x in r.json()["replicas"]))
        m = _metrics(server.base_url, server.headers)
        assert set(per_replica(m, "vllm:num_requests_running")) == {"0", "1"}
    assert len(seen) == 1
    for _ in range(12):  # every process checks the API key
        assert httpx.get(server.base_url + "/v1/models", headers=CLOSE, timeout=30).status_code == 401


def test_openai_client_behind_several_front_ends(server):
    check_openai_client(server, _replica_urls(server)[1] + "/v1")


def test_a_relay_worker_that_dies_is_replaced(server):
    workers = _relay_workers(server)
    argv = open(f"/proc/{workers[0]}/cmdline", "rb").read().decode().split("\0")
    name = argv[argv.index("--name") + 1]
    port = int(server.base_url.rsplit(":", 1)[1])
    theirs = _socket_inodes(workers[0]) & _listening_socket_inodes(port)
    assert len(theirs) == 1, theirs
    os.kill(workers[0], signal.SIGKILL)
    # Until the killed process's listening socket is closed, the kernel may still hand it a new
    # connection, and resets what was queued there when it closes. Its pid turning zombie is not
    # that moment: the leader thread is a zombie while its other threads (ZMQ's, the tokenizer's)
    # still exit, and the last of them closes the descriptors. So wait for the socket itself.
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and theirs & _listening_socket_inodes(port):
        time.sleep(0.01)
    assert not theirs & _listening_socket_inodes(port), "the killed worker's socket still listens after 10 s"
    # The others (and the first front end) keep serving new connections meanwhile.
    with httpx.Client(base_url=server.base_url, headers={**server.headers, **CLOSE}, timeout=120) as c:
        for i in range(10):
            r = c.post("/v1/completions", json={"model": MODEL, "prompt": [30 + i] * 20, "max_tokens": 3})
            assert r.status_code == 200, r.text
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        now = _relay_workers(server)
        listening = server.health()[1]["api_servers_listening"]
        if len(now) == 2 and workers[0] not in now and name in listening:
            break
        time.sleep(0.5)
    assert len(now) == 2 and workers[0] not in now and name in listening, (now, listening)
    # The replacement takes connections and routes through the one router under the dead one's
    # name; nothing the dead one held stays counted in flight.
    before = server.health()[1]["routed_by_api_server"]
    with httpx.Client(base_url=server.base_url, headers={**server.headers, **CLOSE}, timeout=120) as c:
        for i in range(24):
            r = c.post("/v1/completions", json={"model": MODEL, "prompt": [40 + i] * 20, "max_tokens": 3})
            assert r.status_code == 200, r.text
    h = server.health()[1]
    assert h["routed_by_api_server"].get(name, 0) > before.get(name, 0), (name, before, h["routed_by_api_server"])
    assert [r["in_flight"] for r in h["replicas"]] == [0, 0]


def test_killing_a_replica_under_load_behind_several_front_ends(server):
    check_kill_under_load(server, mp_replica_recovered)
