"""DP servers (2 demo-model replicas), one per test module so that the mp replicas are gone
before the Ray cluster starts (the CI machine has 2 cores)."""
from __future__ import annotations

import sys
from pathlib import Path

import httpx
import pytest

sys.path.insert(0, str(Path(__file__).parent))
from dp_helpers import launch_single_server, start_dp_server, stop_process, wait_healthy  # noqa: E402


@pytest.fixture(scope="module")
def mp_server(tmp_path_factory):
    log = tmp_path_factory.mktemp("dp") / "mp_server.log"
    s = start_dp_server(log, "--shutdown-timeout", "3")
    yield s
    stop_process(s.proc)


@pytest.fixture(scope="module")
def ray_server(tmp_path_factory):
    """`--data-parallel-backend ray`: the server starts (and at exit stops) its local cluster."""
    log = tmp_path_factory.mktemp("dp") / "ray_server.log"
    s = start_dp_server(log, "--data-parallel-backend", "ray")
    yield s
    stop_process(s.proc)


@pytest.fixture(scope="module")
def single_server_launched(tmp_path_factory):
    """The one-replica baseline's process, started and not waited for. Name it before a slower
    module-scoped server in a test's arguments (pytest sets up same-scope fixtures in that order)
    and the baseline starts while that server does: with the ray server, ~5 s less than one after
    the other. single_server waits for it and stops it."""
    s = launch_single_server(tmp_path_factory.mktemp("dp") / "single.log")
    yield s
    stop_process(s.proc)  # a no-op when single_server has already stopped it


@pytest.fixture(scope="class")
def single_server(single_server_launched):
    """One replica alone, for the baseline figures; stopped right after its tests (group them in a
    class: one start for all of them, and it is gone before the next test outside the class)."""
    s = single_server_launched
    wait_healthy(s.base_url, s.proc, s.log_path, 180.0, every_replica=False)
    yield s
    stop_process(s.proc)


@pytest.fixture(scope="module")
def mp_http(mp_server):
    with httpx.Client(base_url=mp_server.base_url, headers=mp_server.headers, timeout=120) as c:
        yield c
