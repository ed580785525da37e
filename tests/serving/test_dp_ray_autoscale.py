"""Ray Serve autoscaling end to end (`--data-parallel-backend ray --min-replicas 1
--max-replicas 2`): one replica at rest, two under a load above target_ongoing_requests,
back to one when the load is gone; every request of the load succeeds meanwhile.

Ray's defaults wait 30 s to scale up and 600 s to scale down and push the handles' queue
metrics every 10 s: the test shortens them (--ray-autoscaling-config, and the env var Ray
reads at start-up), so it runs in about two minutes on the 2-core CPU machine."""
from __future__ import annotations

import json
import threading
import time

import httpx
import pytest

pytest.importorskip("ray.serve")

from dp_helpers import MODEL, start_dp_server, stop_process  # noqa: E402

AUTOSCALING = {"upscale_delay_s": 0.0, "downscale_delay_s": 1.0, "look_back_period_s": 1.0,
               "metrics_interval_s": 0.5, "target_ongoing_requests": 2}


def _running(server) -> int:
    try:
        _, h = server.health()
    except (httpx.HTTPError, ValueError):
        return -1
    return h.get("replica_states", {}).get("RUNNING", 0)


def _wait(pred, timeout: float, what: str, server) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout:.0f} s: {what}; health "
                                 f"{server.health()[1]}\n{server.log()}")
        time.sleep(0.5)


@pytest.fixture
def autoscaled_server(tmp_path, monkeypatch):
    monkeypatch.setenv("RAY_SERVE_HANDLE_AUTOSCALING_METRIC_PUSH_INTERVAL_S", "0.5")
    monkeypatch.setenv("RAY_SERVE_REPLICA_AUTOSCALING_METRIC_PUSH_INTERVAL_S", "0.5")
    s = start_dp_server(tmp_path / "ray_autoscale.log", "--data-parallel-backend", "ray",
                        "--min-replicas", "1", "--max-replicas", "2",
                        "--ray-autoscaling-config", json.dumps(AUTOSCALING))
    yield s
    stop_process(s.proc)


@pytest.mark.timeout(420)
def test_ray_autoscaling_follows_the_load(autoscaled_server):
    server = autoscaled_server
    assert _running(server) == 1
    stop = threading.Event()
    failures: list[str] = []
    done = [0]

    def client(i: int) -> None:
        body = {"model": MODEL, "prompt": [5 + i] * 16, "max_tokens": 64, "ignore_eos": True}
        with httpx.Client(base_url=server.base_url, headers=server.headers, timeout=120) as c:
            while not stop.is_set():
                r = c.post("/v1/completions", json=body)
                if r.status_code != 200:
                    failures.append(f"{r.status_code}: {r.text[:200]}")
                    return
                done[0] += 1
    # 8 in flight against target_ongoing_requests 2: Ray asks for more than max_replicas.
    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(8)]
    for t in threads:
        t.start()
    try:
        _wait(lambda: _running(server) == 2 or failures, 240, "a second replica under load", server)
        assert not failures, failures[:3]
        n = done[0]
        _wait(lambda: done[0] > n + 4 or failures, 60, "requests served by two replicas", server)
    finally:
        stop.set()
        for t in threads:
            t.join(150)
    assert not failures, failures[:3]
    _wait(lambda: _running(server) == 1, 120, "back to one replica without load", server)

    def settled() -> bool:  # the other one stopped, its reports gone stale
        h = server.health()[1]
        return h["status"] == "ok" and h["replica_states"] == {"RUNNING": 1}
    _wait(settled, 60, "health ok with one replica", server)
    r = httpx.post(server.base_url + "/v1/completions", headers=server.headers, timeout=120,
                   json={"model": MODEL, "prompt": [7] * 8, "max_tokens": 4})
    assert r.status_code == 200, r.text
