"""Screenshots of the KV dashboard for the docs: a loaded demo server and a sim replay.

    python scripts/dashboard_screenshots.py          # writes docs/figures/dashboard_{live,sim}.png

Needs Debian's chromium (apt-get install chromium) and Playwright for Python.
"""
from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
from playwright.sync_api import sync_playwright

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from pagedserve.benchmark.server_process import stop_process, wait_until_ready  # noqa: E402

OUT = REPO / "docs" / "figures"
CHROMIUM = os.environ.get("PAGEDSERVE_CHROMIUM", "/usr/bin/chromium")
KEY = "sk-screenshot"


def _start(cmd: list[str], ready_url: str) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    proc = subprocess.Popen([sys.executable, "-m", "pagedserve.entrypoints.cli", *cmd], env=env, cwd=REPO,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_until_ready(proc, ready_url, 300, interval=0.5)
    except RuntimeError as e:
        stop_process(proc)
        raise SystemExit(f"{cmd[0]} did not come up: {e}") from None
    return proc


def _stop(proc: subprocess.Popen) -> None:
    stop_process(proc, timeout=15)


def _load(base: str) -> threading.Thread:
    """Requests that share a prompt prefix, some forked (n=2), more than the cache holds."""
    def one(i: int) -> None:
        prompt = "And God said, Let there be light: and there was light. " * (1 + i % 3) + f"Verse {i}."
        body = {"model": "pagedserve-demo", "prompt": prompt, "max_tokens": 400, "n": 1 + (i % 4 == 0),
                "temperature": 0.8, "seed": i, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", base + "/v1/completions", headers={"Authorization": f"Bearer {KEY}"},
                          timeout=300, json=body) as r:
            for _ in r.iter_lines():
                pass

    def run() -> None:
        threads = [threading.Thread(target=one, args=(i,)) for i in range(28)]
        for t in threads:
            t.start()
            time.sleep(0.15)
        for t in threads:
            t.join()
    t = threading.Thread(target=run)
    t.start()
    return t


def live(browser) -> None:
    port = 18931
    base = f"http://127.0.0.1:{port}"
    proc = _start(["serve", "--device", "cpu", "--port", str(port), "--api-key", KEY,
                   "--num-gpu-blocks-override", "256", "--swap-space", "0.008",
                   "--preemption-mode", "swap"], base + "/health")
    try:
        page = browser.new_page(viewport={"width": 1400, "height": 1050})
        page.goto(f"{base}/dashboard#key={KEY}")
        page.wait_for_function("document.body.dataset.status === 'live'")
        load = _load(base)
        page.wait_for_function("document.querySelectorAll('#cpu-map .cell[data-state=used]').length > 8 && "
                               "document.querySelectorAll('#gpu-map .cell[data-state=shared]').length > 4",
                               timeout=180_000)
        time.sleep(0.5)
        page.screenshot(path=str(OUT / "dashboard_live.png"), full_page=True)
        load.join()
    finally:
        _stop(proc)


def sim(browser) -> None:
    port = 18932
    base = f"http://127.0.0.1:{port}"
    proc = _start(["sim", "--dashboard", "--port", str(port), "--workload", "sharegpt-like",
                   "--allocator", "contiguous-max", "--num-requests", "200"], base + "/dashboard/config")
    try:
        page = browser.new_page(viewport={"width": 1400, "height": 1050})
        page.goto(f"{base}/dashboard")
        page.wait_for_function("document.getElementById('sim-step').dataset.value === '1'")
        httpx.post(base + "/sim/step?n=120", timeout=60)
        page.click("#sim-step-btn")
        page.wait_for_function("Number(document.getElementById('sim-step').dataset.value) > 120")
        page.mouse.move(40, 180)
        page.screenshot(path=str(OUT / "dashboard_sim.png"), full_page=True)
    finally:
        _stop(proc)


def main() -> int:
    OUT.mkdir(parents=True, exist_ok=True)
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        live(browser)
        sim(browser)
        browser.close()
    print(f"wrote {OUT / 'dashboard_live.png'} and {OUT / 'dashboard_sim.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
