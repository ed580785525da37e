"""`pagedserve sim --dashboard` in a real browser: step, switch allocator, play and pause, with
the page's cells equal to the replay's /kv_cache/state at every stop."""
from __future__ import annotations

import os
import subprocess
import sys
import time

import httpx
import pytest

from browser import PAGE_STATES_JS, browser  # noqa: F401 (fixture)
from server_process import REPO, free_port

NUM_BLOCKS = 200


@pytest.fixture(scope="module")
def sim_url(tmp_path_factory):
    port = free_port()
    log = open(tmp_path_factory.mktemp("sim") / "sim.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "pagedserve.entrypoints.cli", "sim", "--dashboard",
                             "--port", str(port), "--workload", "sharegpt-like", "--num-requests", "60",
                             "--num-blocks", str(NUM_BLOCKS)],
                            stdout=log, stderr=subprocess.STDOUT, cwd=REPO,
                            env=dict(os.environ, PYTHONPATH=f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"))
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        assert proc.poll() is None, "the sim dashboard exited"
        try:
            if httpx.get(url + "/dashboard/config", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, "the sim dashboard did not come up"
        time.sleep(0.2)
    yield url
    proc.terminate()
    proc.wait(timeout=20)


def _agrees(page, url) -> dict:
    """Wait until the page shows the replay's current frame, then compare every cell."""
    state = httpx.get(url + "/kv_cache/state", timeout=30).json()
    page.wait_for_function(f"document.body.dataset.version === '{state['version']}'", timeout=10_000)
    shown = page.evaluate(PAGE_STATES_JS)
    assert shown["states"] == [b["state"] for b in state["blocks"]]
    return state


def test_replay_steps_plays_and_switches_allocator(browser, sim_url):  # noqa: F811
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    page.goto(sim_url + "/dashboard")
    page.wait_for_function("document.getElementById('sim-step').dataset.value === '1'", timeout=15_000)
    assert page.locator("#gpu-map .cell").count() == NUM_BLOCKS
    first = _agrees(page, sim_url)

    page.click("#sim-step-btn")
    page.wait_for_function("document.getElementById('sim-step').dataset.value === '2'", timeout=10_000)
    second = _agrees(page, sim_url)
    assert second["sim"]["step"] == 2 and second["stats"] != first["stats"]
    # Hovering a cell names its owners and their logical block; the tables panel lists requests.
    block = next(b for b in second["blocks"] if b["owners"])
    page.hover(f'#gpu-map .cell[data-block="{block["block"]}"]')
    tip = page.locator("#tooltip").text_content()
    for rid, sid, idx in block["owners"]:
        assert f"req {rid} · seq {sid} · logical block {idx}" in tip
    assert page.locator("#tables .req").count() == min(48, len(second["requests"]))

    page.select_option("#sim-allocator", "contiguous-max")
    page.wait_for_function("document.getElementById('allocator-name').textContent === 'contiguous-max' && "
                           "document.getElementById('sim-step').dataset.value === '1'", timeout=15_000)
    state = _agrees(page, sim_url)
    assert "reserved" in [b["state"] for b in state["blocks"]]
    assert page.locator('#gpu-map .cell[data-state="reserved"]').count() > 0

    page.click("#sim-play")
    page.wait_for_function("Number(document.getElementById('sim-step').dataset.value) >= 6", timeout=15_000)
    page.click("#sim-play")  # pause
    assert page.locator("#sim-play").text_content() == "Play"
    state = _agrees(page, sim_url)
    assert state["sim"]["step"] >= 6
    page.close()
