"""The live dashboard in a real browser: cells, states and counters agree with the server's own
/kv_cache/state and /metrics, and the page reconnects after the server restarts."""
from __future__ import annotations

import threading

import httpx
import pytest

from browser import PAGE_METRICS_JS, PAGE_STATES_JS, browser  # noqa: F401 (fixture)
from server_process import free_port, start_server, stop_server

KEY = "sk-dashboard-test"
NUM_BLOCKS = 64
RESTART_BLOCKS = 48
BASE_ARGS = ("--max-model-len", "256", "--block-size", "16", "--max-num-seqs", "16", "--swap-space", "0.01")


class DashServer:
    """One server on a fixed port, so the page can find it again after a restart."""

    def __init__(self, model_dir, log_dir) -> None:
        self.model_dir, self.log_dir = model_dir, log_dir
        self.port = free_port()
        self.server = None

    def start(self, num_blocks: int) -> None:
        self.server = start_server(self.model_dir, self.log_dir / f"dash-{num_blocks}.log", *BASE_ARGS,
                                   "--num-gpu-blocks-override", str(num_blocks), api_key=KEY, port=self.port)

    def stop(self, crash: bool = False) -> None:
        if self.server is not None:
            if crash:
                self.server.proc.kill()
                self.server.proc.wait()
            else:
                stop_server(self.server)
            self.server = None

    def state(self) -> dict:
        r = httpx.get(self.server.base_url + "/kv_cache/state", headers={"Authorization": f"Bearer {KEY}"},
                      timeout=60)
        r.raise_for_status()
        return r.json()


@pytest.fixture(scope="module")
def dash(tiny_model_dir, tmp_path_factory):
    d = DashServer(tiny_model_dir("llama"), tmp_path_factory.mktemp("dash"))
    d.start(NUM_BLOCKS)
    yield d
    d.stop()


@pytest.fixture(scope="module")
def page(browser, dash):  # noqa: F811
    p = browser.new_page(viewport={"width": 1400, "height": 1000})
    # The key rides in the fragment, which the browser never sends to the server.
    p.goto(f"{dash.server.base_url}/dashboard?interval=0.25#key={KEY}")
    p.wait_for_function("document.body.dataset.status === 'live' && document.body.dataset.version",
                        timeout=30_000)
    yield p
    p.close()


def _load(base_url: str, n_requests: int = 10) -> threading.Thread:
    """Concurrent requests that share a prompt prefix and fork (n=2), enough to preempt. The
    first runs alone, so its prefix blocks are cached before the others look them up: requests
    that all arrive in one step would each compute the prefix and hit nothing (seen on CI)."""
    prefix = "In the beginning God created the heaven and the earth. "

    def one(i: int) -> None:
        with httpx.Client(base_url=base_url, headers={"Authorization": f"Bearer {KEY}"}, timeout=120) as c:
            r = c.post("/v1/completions", json={"model": "tiny", "prompt": prefix + f"Verse {i}.",
                                                "max_tokens": 120, "n": 2 if i % 2 else 1,
                                                "temperature": 1.0, "seed": i, "ignore_eos": True})
            r.raise_for_status()

    def run() -> None:
        one(0)
        threads = [threading.Thread(target=one, args=(i,)) for i in range(1, n_requests)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    t = threading.Thread(target=run)
    t.start()
    return t


def test_one_cell_per_engine_block(page, dash):
    shown = page.evaluate(PAGE_STATES_JS)
    state = dash.state()
    assert state["num_blocks"] == NUM_BLOCKS  # the engine's block count (--num-gpu-blocks-override)
    assert shown["blocks"] == list(range(NUM_BLOCKS))


def test_cell_states_and_counters_agree_with_the_server(page, dash):
    load = _load(dash.server.base_url)
    matched, busy = 0, False
    try:
        for _ in range(200):
            if matched >= 3 and busy or not load.is_alive():
                break
            shown = page.evaluate(PAGE_STATES_JS)
            state = dash.state()
            # Both read the server's shared snapshot; the same version is the same instant.
            if shown["version"] == str(state["version"]):
                assert shown["states"] == [b["state"] for b in state["blocks"]]
                matched += 1
                busy = busy or any(s in ("used", "shared") for s in shown["states"])
    finally:
        load.join()
    assert matched >= 1 and busy, f"never caught the page and the server on one busy snapshot ({matched} matches)"

    # Quiet now: wait for a frame taken after the last request, then everything must agree.
    state = dash.state()
    page.wait_for_function(f"Number(document.body.dataset.version) > {state['version']}", timeout=10_000)
    shown = page.evaluate(PAGE_STATES_JS)
    state = dash.state()
    assert shown["states"] == [b["state"] for b in state["blocks"]]
    assert "cached" in shown["states"]  # finished prompts stay as prefix cache
    metrics = dash.server.metrics()
    on_page = page.evaluate(PAGE_METRICS_JS)
    assert set(on_page) == {"pagedserve:kv_cache_usage_perc", "pagedserve:prefix_cache_hit_rate",
                            "pagedserve:num_preemptions_total", "pagedserve:num_requests_running",
                            "pagedserve:num_requests_waiting", "pagedserve:num_requests_swapped"}
    for name, value in on_page.items():
        assert value == pytest.approx(metrics[name], abs=1e-9), name
    assert on_page["pagedserve:num_preemptions_total"] > 0 and on_page["pagedserve:prefix_cache_hit_rate"] > 0


def test_page_recovers_after_server_restart(page, dash):
    # Killed, not stopped: uvicorn's graceful shutdown would wait for the page's open stream.
    dash.stop(crash=True)
    page.wait_for_function("document.body.dataset.status === 'reconnecting'", timeout=15_000)
    dash.start(RESTART_BLOCKS)  # same port, a different cache: the grid must be rebuilt
    page.wait_for_function(f"document.body.dataset.status === 'live' && "
                           f"document.querySelectorAll('#gpu-map .cell').length === {RESTART_BLOCKS}",
                           timeout=30_000)
    state = dash.state()
    page.wait_for_function(f"Number(document.body.dataset.version) >= {state['version']}", timeout=10_000)
    shown = page.evaluate(PAGE_STATES_JS)
    assert shown["states"] == [b["state"] for b in dash.state()["blocks"]] == ["free"] * RESTART_BLOCKS


SPEC_JS = """() => Object.fromEntries(Array.from(document.querySelectorAll('.spec-row [data-counter]'),
  el => [el.dataset.counter, el.dataset.value === undefined ? null : Number(el.dataset.value)]))"""


def test_speculation_row_shows_the_engines_counters(browser, tiny_model_dir, tmp_path):  # noqa: F811
    """With --speculative-config the page shows acceptance, mean accepted length and proposer time,
    the values of the server's /kv_cache/state on the same frame (hidden without speculation:
    the other tests' server has none)."""
    d = DashServer(tiny_model_dir("llama"), tmp_path)
    d.server = start_server(d.model_dir, tmp_path / "spec.log", *BASE_ARGS, "--num-gpu-blocks-override", "64",
                            "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}',
                            api_key=KEY, port=d.port)
    p = browser.new_page()
    try:
        r = httpx.post(d.server.base_url + "/v1/completions", headers={"Authorization": f"Bearer {KEY}"},
                       json={"model": "tiny", "prompt": "alpha beta gamma delta epsilon " * 8, "max_tokens": 48,
                             "temperature": 0.0, "ignore_eos": True}, timeout=120)
        r.raise_for_status()
        state = d.state()
        sd = state["spec_decode"]
        assert sd["num_draft_tokens"] > 0 and sd["proposer_seconds"] > 0, sd  # it proposed and was timed
        p.goto(f"{d.server.base_url}/dashboard?interval=0.25#key={KEY}")
        p.wait_for_function(f"Number(document.body.dataset.version) >= {state['version']}", timeout=30_000)
        assert p.is_visible(".spec-row")
        shown = p.evaluate(SPEC_JS)
        assert shown == pytest.approx({"spec_acceptance": sd["acceptance_rate"],
                                       "spec_mean_accepted": sd["mean_accepted_length"],
                                       "spec_proposer_s": sd["proposer_seconds"]}, abs=1e-9)
    finally:
        p.close()
        d.stop()
