"""The dashboard's HTTP side on the shared server (--api-key on): the data endpoints need the
key, the page does not; /kv_cache/state describes the engine's cache; bad input is a 400."""
from __future__ import annotations

import threading

import httpx

from server_process import BLOCK_SIZE, NUM_BLOCKS


def test_data_needs_the_key_and_the_page_does_not(server):
    for path in ("/kv_cache/state", "/kv_cache/events"):
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": server.api_key}):
            r = httpx.get(server.base_url + path, headers=headers, timeout=30)
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", (path, headers)
    page = httpx.get(server.base_url + "/dashboard", timeout=30)
    assert page.status_code == 200 and 'id="gpu-map"' in page.text
    assert "http" not in page.text.replace("http-equiv", "")  # no CDN: every asset is our own
    for asset in ("dashboard.js", "dashboard.css"):
        assert httpx.get(f"{server.base_url}/dashboard/static/{asset}", timeout=30).status_code == 200
    assert httpx.get(server.base_url + "/dashboard/static/secret.py", timeout=30).status_code == 404


def test_state_describes_the_engine_cache(http):
    state = http.get("/kv_cache/state").json()
    assert state["num_blocks"] == NUM_BLOCKS and state["block_size"] == BLOCK_SIZE
    assert [b["block"] for b in state["blocks"]] == list(range(NUM_BLOCKS))
    assert {b["state"] for b in state["blocks"]} <= {"free", "used", "shared", "cached"}
    stats = state["stats"]
    assert stats["num_blocks_total"] == NUM_BLOCKS
    assert stats["num_blocks_used"] == sum(b["state"] in ("used", "shared") for b in state["blocks"])


def _watch_a_forked_request(server, http):
    """Run one n=2 request and poll /kv_cache/state while it runs; (state, request) of the first
    snapshot that shows it forked, or None if it finished first."""
    done = threading.Event()

    def run():
        try:
            http.post("/v1/completions", json={"model": server.model, "prompt": "In the beginning " * 6,
                                               "max_tokens": 400, "n": 2, "temperature": 1.0, "seed": 3,
                                               "ignore_eos": True})
        finally:
            done.set()
    t = threading.Thread(target=run)
    t.start()
    seen = None
    while not done.is_set() and seen is None:
        state = http.get("/kv_cache/state").json()
        for r in state["requests"]:
            if len(r["seqs"]) == 2 and all(s["num_computed_tokens"] > 0 for s in r["seqs"]):
                seen = state, r
    t.join()
    return seen


def test_a_running_request_shows_its_blocks(server, http):
    """A forked (n=2) request is seen with two sequences whose tables share its prompt blocks."""
    # Snapshots are throttled (and back off further when they are slow, as on a loaded CI machine),
    # so a short request can finish between two of them: watch a few requests, not just one.
    for _ in range(5):
        seen = _watch_a_forked_request(server, http)
        if seen is not None:
            break
    assert seen is not None, "every request finished before any snapshot saw it forked"
    state, req = seen
    first = [s["block_table"][0] for s in req["seqs"]]
    assert first[0] == first[1]  # the prompt's first block, shared by both sequences
    block = state["blocks"][first[0]]
    assert block["state"] == "shared"
    assert sorted(o[1] for o in block["owners"]) == sorted(s["seq_id"] for s in req["seqs"])
    assert all(o[0] == req["request_id"] and o[2] == 0 for o in block["owners"])


def test_bad_interval_is_a_400(http):
    r = http.get("/kv_cache/events", params={"interval": "0.01"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "interval"
