"""One DP server (mp backend, 2 demo-model replicas) per test session."""
from __future__ import annotations

import sys
from pathlib import Path

import httpx
import pytest

sys.path.insert(0, str(Path(__file__).parent))
from dp_helpers import API_KEY, start_mp_server, stop_process  # noqa: E402


@pytest.fixture(scope="session")
def mp_server(tmp_path_factory):
    log = tmp_path_factory.mktemp("dp") / "mp_server.log"
    s = start_mp_server(log)
    yield s
    stop_process(s.proc)


@pytest.fixture(scope="session")
def mp_http(mp_server):
    with httpx.Client(base_url=mp_server.base_url, headers=mp_server.headers, timeout=120) as c:
        yield c
