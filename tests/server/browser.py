"""Headless Chromium for the dashboard tests: Debian's system browser driven by Playwright
(Playwright never downloads a browser of its own here). Without chromium the tests skip,
unless PAGEDSERVE_REQUIRE_BROWSER=1 (CI sets it), which turns the skip into a failure."""
from __future__ import annotations

import os
import shutil

import pytest

CHROMIUM = os.environ.get("PAGEDSERVE_CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")


def launch_browser(playwright):
    if CHROMIUM is None:
        if os.environ.get("PAGEDSERVE_REQUIRE_BROWSER") == "1":
            pytest.fail("PAGEDSERVE_REQUIRE_BROWSER=1 but no chromium on PATH (Debian: apt-get install chromium)")
        pytest.skip("no system chromium (Debian: apt-get install chromium)")
    return playwright.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox", "--disable-gpu"])


@pytest.fixture(scope="module")
def browser():
    if CHROMIUM is None:
        launch_browser(None)
    from playwright.sync_api import sync_playwright
    with sync_playwright() as p:
        b = launch_browser(p)
        yield b
        b.close()


PAGE_STATES_JS = """() => ({
  version: document.body.dataset.version || null,
  status: document.body.dataset.status,
  states: Array.from(document.querySelectorAll('#gpu-map .cell'), c => c.dataset.state),
  blocks: Array.from(document.querySelectorAll('#gpu-map .cell'), c => Number(c.dataset.block)),
})"""

PAGE_METRICS_JS = """() => Object.fromEntries(Array.from(document.querySelectorAll('[data-metric]'),
  e => [e.dataset.metric, Number(e.dataset.value)]))"""
