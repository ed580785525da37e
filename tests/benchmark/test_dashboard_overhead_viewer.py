"""benchmarks/dashboard_overhead.py's SSE viewer against a real stream (uvicorn, the live router
over a real scheduler): the load may start only once the viewer has its first frame, and the
frames are counted over the load's window only."""
from __future__ import annotations

import socket
import sys
import threading
import time
from pathlib import Path

import pytest
import uvicorn
from fastapi import FastAPI

from core.core_helpers import Driver, make_group, make_scheduler
from pagedserve.core.kv_state import kv_cache_state
from pagedserve.entrypoints.openai.dashboard import dashboard_router
from pagedserve.metrics import ServerMetrics

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import dashboard_overhead as bench  # noqa: E402


class SchedulerEngine:
    """What the dashboard router needs from AsyncLLMEngine; the cache moves at every snapshot."""

    def __init__(self) -> None:
        self.sched = make_scheduler(64, block_size=4)
        for i in range(4):
            self.sched.add_seq_group(make_group(str(i), list(range(9)), max_tokens=200))
        self.driver = Driver(self.sched)
        self.metrics = ServerMetrics()

    async def get_kv_cache_state(self) -> dict:
        if self.sched.has_unfinished_seqs():
            self.driver.step()
        return kv_cache_state(self.sched)


@pytest.fixture
def stream_url():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    app = FastAPI()
    app.include_router(dashboard_router(SchedulerEngine(), bench.KEY))
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.05)
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(timeout=10)


def test_sse_viewer_is_ready_before_the_load_and_counts_only_its_window(stream_url):
    with bench.SSEViewer(stream_url, 0.25) as viewer:
        t0 = time.monotonic()  # the load would start here
        time.sleep(1.5)  # a few of the stream's ticks of "load"
        t1 = time.monotonic()
    assert viewer.arrivals[0][0] <= t0  # its first frame came before __enter__ returned
    result = viewer.result(t0, t1)
    inside = [t for t, _ in viewer.arrivals if t0 <= t <= t1]
    assert result["viewer_frames"] == len(inside) > 0
    assert result["viewer_hz"] == pytest.approx(len(inside) / (t1 - t0))
    assert result["viewer_first_frame_before_load_s"] >= 0
