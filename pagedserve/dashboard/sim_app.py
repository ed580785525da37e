"""`pagedserve sim --dashboard`: the dashboard page over a simulator replay instead of a server.

POST /sim/step?n=N advances N steps (0: none) and POST /sim/reset?allocator=A restarts with
another allocator; both answer the frame the page draws. GET /kv_cache/state is the same
JSON as a live server's. No model, no torch: the replay drives the real scheduler only.
"""
from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.responses import JSONResponse

from pagedserve.config import KV_ALLOCATORS
from pagedserve.dashboard.feed import public_state
from pagedserve.dashboard.page import page_router
from pagedserve.dashboard.sim_replay import SimReplay

MAX_STEPS_PER_CALL = 1000


def _bad(message: str, param: str) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": "invalid_request_error", "param": param,
                                   "code": None}}, status_code=400)


def build_sim_app(replay: SimReplay) -> FastAPI:
    app = FastAPI(title="pagedserve sim dashboard")
    app.include_router(page_router({"mode": "sim", "allocators": list(KV_ALLOCATORS),
                                    "allocator": replay.allocator,
                                    "workload": replay.sim_kwargs.get("workload", "sharegpt-like")}))

    # Plain (sync) handlers: FastAPI runs them in its thread pool while the replay steps.
    @app.post("/sim/step")
    def sim_step(n: str = "1") -> Any:
        if not n.isdigit() or int(n) > MAX_STEPS_PER_CALL:
            return _bad(f"n must be an integer in [0, {MAX_STEPS_PER_CALL}], got {n!r}", "n")
        return replay.advance(int(n))

    @app.post("/sim/reset")
    def sim_reset(allocator: str = "paged") -> Any:
        if allocator not in KV_ALLOCATORS:
            return _bad(f"allocator must be one of {list(KV_ALLOCATORS)}, got {allocator!r}", "allocator")
        replay.reset(allocator)
        return replay.advance(0)

    @app.get("/kv_cache/state")
    def kv_cache_state() -> Any:
        return public_state(replay.advance(0))

    return app


def run_sim_dashboard(args: Any) -> int:
    """Serve the replay of the workload the other sim flags describe, until interrupted."""
    import uvicorn

    extra = {}
    if getattr(args, "model", None):
        from pagedserve.sim import StepTimeModel
        extra["time_model"] = StepTimeModel.for_model_dir(args.model)
    replay = SimReplay(args.allocator, workload=args.workload, block_size=args.block_size,
                       num_blocks=args.num_blocks, num_requests=args.num_requests,
                       request_rate=args.request_rate, max_num_seqs=args.max_num_seqs,
                       max_model_len=args.max_model_len, seed=args.seed, **extra)
    app = build_sim_app(replay)
    print(f"\nReplaying {args.workload} at http://{args.host}:{args.port}/dashboard "
          f"(play, pause, step; pick the allocator on the page)\n", flush=True)
    try:
        uvicorn.run(app, host=args.host, port=args.port, log_level="warning")
    finally:
        replay.close()
    return 0
