"""The sim replay behind `pagedserve sim --dashboard`: it steps exactly as asked, matches an
uninterrupted simulate() run step for step, switches allocator, and answers 400 on bad input."""
from fastapi.testclient import TestClient

from pagedserve.core.kv_state import kv_cache_state, state_names
from pagedserve.dashboard.sim_app import build_sim_app
from pagedserve.dashboard.sim_replay import SimReplay
from pagedserve.sim import simulate

KW = dict(workload="alpaca-like", num_requests=30, num_blocks=120)


def _tables(state):
    """Request -> block tables; seq ids are process-wide counters, so they are left out."""
    return {r["request_id"]: [s["block_table"] for s in r["seqs"]] for r in state["requests"]}


def test_replay_matches_a_straight_run_step_by_step():
    straight = []
    simulate(allocator="paged", on_step=lambda s, sch: straight.append(kv_cache_state(sch)), max_steps=12, **KW)
    replay = SimReplay("paged", **KW)
    try:
        frames = [replay.advance(0)] + [replay.advance(1) for _ in range(4)] + [replay.advance(7)]
        assert [f["sim"]["step"] for f in frames] == [1, 2, 3, 4, 5, 12]
        for f in frames:
            want = straight[f["sim"]["step"] - 1]
            assert f["states"] == want["states"] and _tables(f) == _tables(want)
            assert f["stats"] == want["stats"]
    finally:
        replay.close()


def test_app_steps_resets_and_rejects_bad_input():
    replay = SimReplay("paged", **KW)
    try:
        c = TestClient(build_sim_app(replay))
        assert c.post("/sim/step?n=3").json()["sim"]["step"] == 4
        f = c.post("/sim/reset?allocator=contiguous-oracle").json()
        assert f["sim"] == {"step": 1, "done": False, "allocator": "contiguous-oracle", "workload": "alpaca-like"}
        assert "reserved" in state_names(f["states"]) or "used" in state_names(f["states"])
        state = c.get("/kv_cache/state").json()
        assert [b["state"] for b in state["blocks"]] == state_names(f["states"])
        for path, param in (("/sim/step?n=-1", "n"), ("/sim/step?n=5000", "n"), ("/sim/reset?allocator=buddy", "allocator")):
            r = c.post(path)
            assert r.status_code == 400 and r.json()["error"]["param"] == param
        done = c.post("/sim/step?n=1000").json()
        while not done["sim"]["done"]:
            done = c.post("/sim/step?n=1000").json()
        assert set(state_names(done["states"])) <= {"free"} and done["requests"] == []
    finally:
        replay.close()
