"""benchmarks/dashboard/dashboard_overhead.py's SSE viewer against a real stream (uvicorn, the live router
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

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks" / "dashboard"))
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


def _segment(i, opened, rate, counted=True):
    return {"index": i, "open": opened, "output_tok_s": rate, "counted": counted,
            **({"viewer_hz": 2.5} if opened else {})}


def test_toggle_drop_pairs_each_open_segment_with_its_closed_neighbours():
    segments = [_segment(0, False, 500.0, counted=False),  # the ramp: not counted
                _segment(1, True, 900.0),                   # no counted closed segment before it
                _segment(2, False, 1000.0),
                _segment(3, True, 950.0),                   # neighbours 1000 and 1100: drop 1 - 950/1050
                _segment(4, False, 1100.0),
                _segment(5, True, 1100.0),                  # neighbours 1100 and 1100: drop 0
                _segment(6, False, 1100.0),
                _segment(7, True, 800.0),                   # its right neighbour is not counted
                _segment(8, False, 400.0, counted=False)]
    got = bench.toggle_drop(segments)
    assert got["paired_drops"] == pytest.approx([1 - 950 / 1050, 0.0])
    assert got["paired_drop_median"] == pytest.approx((1 - 950 / 1050) / 2)
    assert got["paired_drop_mean"] == pytest.approx((1 - 950 / 1050) / 2)
    half = 1.96 * (1 - 950 / 1050) / 2 ** 0.5 / 2 ** 0.5  # the two pairs' stdev is their gap over sqrt(2)
    assert got["paired_drop_mean_ci95"] == pytest.approx([got["paired_drop_mean"] - half, got["paired_drop_mean"] + half])
    assert got["open_segment_tok_s_median"] == 925.0       # 800, 900, 950, 1100
    assert got["closed_segment_tok_s_median"] == 1100.0    # 1000, 1100, 1100
    assert bench.toggle_drop(segments[:2])["paired_drop_median"] is None


def test_engine_segment_rates_count_the_decodes_launched_inside_each_segment():
    segments = [{"index": 0, "open": False, "counted": True, "start_unix": 100.0, "end_unix": 102.0},
                {"index": 1, "open": True, "counted": True, "start_unix": 102.5, "end_unix": 104.5, "viewer_hz": 2.5},
                {"index": 2, "open": False, "counted": True, "start_unix": 105.0, "end_unix": 107.0}]
    steps = [{"t": 99.9, "seqs": 64, "decodes": 64},    # before the first segment
             {"t": 100.0, "seqs": 64, "decodes": 60},   # at its start: in
             {"t": 101.0, "seqs": 32, "decodes": 30},
             {"t": 102.0, "seqs": 64, "decodes": 64},   # at its end: out, and before the next
             {"t": 103.0, "seqs": 10, "decodes": 9},
             {"t": 105.5, "seqs": 64, "decodes": 64},
             {"t": 106.0, "seqs": 40, "decodes": 38}]
    bench.engine_segment_rates(steps, segments)
    assert [s["engine_decode_tok_s"] for s in segments] == pytest.approx([45.0, 4.5, 51.0])
    assert [s["engine_mean_seqs"] for s in segments] == pytest.approx([48.0, 10.0, 52.0])
    drop = bench.toggle_drop(segments, "engine_decode_tok_s")
    assert drop["paired_drops"] == pytest.approx([1 - 4.5 / 48.0])
