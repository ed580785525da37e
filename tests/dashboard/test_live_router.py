"""The live dashboard router over a real scheduler: with and without an API key."""
from fastapi import FastAPI
from fastapi.testclient import TestClient

from core.core_helpers import Driver, make_group, make_scheduler
from pagedserve.core.kv_state import kv_cache_state, state_names
from pagedserve.entrypoints.openai.api_server import _install_error_handlers
from pagedserve.entrypoints.openai.dashboard import dashboard_router
from pagedserve.metrics import ServerMetrics


class SchedulerEngine:
    """What the router needs from AsyncLLMEngine, backed by a real scheduler."""

    def __init__(self, sched) -> None:
        self.sched = sched
        self.metrics = ServerMetrics()

    async def get_kv_cache_state(self) -> dict:
        return kv_cache_state(self.sched)


def _client(api_key):
    sched = make_scheduler(16, block_size=4)
    sched.add_seq_group(make_group("r1", list(range(9)), max_tokens=6))
    Driver(sched).step()
    engine = SchedulerEngine(sched)
    engine.metrics.generation_tokens.inc(5)
    app = FastAPI()
    _install_error_handlers(app)
    app.include_router(dashboard_router(engine, api_key))
    return TestClient(app), sched


def test_open_without_a_key():
    client, sched = _client(None)
    state = client.get("/kv_cache/state").json()
    assert [b["state"] for b in state["blocks"]] == state_names(kv_cache_state(sched)["states"])
    assert state["requests"][0]["request_id"] == "r1"
    assert state["metrics"]["generation_tokens_total"] == 5.0
    assert client.get("/dashboard/config").json() == {"mode": "live", "needs_key": False}


def test_key_required_when_set():
    client, _ = _client("s3cret")
    assert client.get("/kv_cache/state").status_code == 401
    assert client.get("/kv_cache/state", headers={"Authorization": "Bearer nope"}).status_code == 401
    ok = client.get("/kv_cache/state", headers={"Authorization": "Bearer s3cret"})
    assert ok.status_code == 200 and ok.json()["num_blocks"] == 16
    assert client.get("/dashboard").status_code == 200  # the page holds no data
    assert client.get("/dashboard/config").json()["needs_key"] is True
