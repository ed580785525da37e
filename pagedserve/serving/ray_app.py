"""The ray backend: the replicas are a Ray Serve deployment, the endpoint its ingress.

  HTTP -> Ray Serve proxy -> PagedServeIngress (front end, frontend.py + RayReplicaPool)
       -> DeploymentHandle + PrefixAffinityRequestRouter -> EngineReplica x N

Ray places the replicas (each asks for --tensor-parallel-size GPUs), health-checks them
(check_health: the engine loop is alive), restarts dead ones and autoscales between
--min-replicas and --max-replicas. Each EngineReplica runs one engine and the ordinary
pagedserve OpenAI app (validation, streaming, errors are the single server's) and reports
its /metrics text to a small named actor, the board, which the ingress reads for the
aggregated /metrics and for /health.
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import os
import signal
import time
from typing import Any, AsyncIterator, Sequence

import ray
from ray import serve
from ray.serve.config import RequestRouterConfig

from pagedserve.config import SMALL_DEVICE_MAX_NUM_SEQS, EngineConfig
from pagedserve.entrypoints.openai.serving_common import SSE_DONE, APIError, error_event
from pagedserve.serving.pool import NoReplicaAvailable, ReplicaFailed, ReplicaResponse, one_chunk

logger = logging.getLogger("pagedserve.dp")

APP_NAME = "pagedserve"
ENGINE_DEPLOYMENT = "EngineReplica"
REPORT_INTERVAL_S = 0.5
STALE_AFTER_S = 3.0  # a replica silent this long is gone (dead or restarting)
# The ingress only forwards: each request it holds waits on an EngineReplica, whose own
# max_ongoing_requests (max_num_seqs) bounds the work and past which Ray's router queues. Serve's
# default for a deployment (5) would cap the whole DP endpoint at 5 requests in flight, whatever
# the replicas' batch size; Ray Serve LLM's ingress is likewise unbounded (1e9).
INGRESS_MAX_ONGOING_REQUESTS = 1_000_000_000
# A replica being stopped (downscaled, its app deleted) sleeps this long before each check for
# requests still in flight: Serve's 2 s default made every idle replica take 2 s to stop.
SHUTDOWN_POLL_S = 0.5


@ray.remote(num_cpus=0)
class ReplicaBoard:
    """Latest report of each replica: label -> (time, pid, /metrics text)."""

    def __init__(self) -> None:
        self.reports: dict[str, tuple[float, int, str]] = {}

    def report(self, label: str, pid: int, metrics_text: str) -> None:
        self.reports[label] = (time.time(), pid, metrics_text)

    def fresh(self, max_age_s: float) -> dict[str, tuple[float, int, str]]:
        now = time.time()
        return {k: v for k, v in self.reports.items() if now - v[0] <= max_age_s}


def _board_name(app_name: str) -> str:
    return f"pagedserve-replica-board-{app_name}"


def _board(app_name: str):
    """The app's board; detached so that it outlives any one replica (deleted with the app)."""
    return ReplicaBoard.options(name=_board_name(app_name), namespace="serve",
                                get_if_exists=True, lifetime="detached").remote()


class EngineReplica:
    """One engine and its OpenAI app, served through a Ray handle."""

    async def __init__(self, config: dict, served_name: str, max_request_bytes: int) -> None:
        from pagedserve.engine.async_engine import AsyncLLMEngine
        from pagedserve.entrypoints.openai.api_server import build_app
        engine_config = EngineConfig(**config)
        # specs_checked: build_app's handlers parse every structured-output spec (check_compiles).
        self.engine = AsyncLLMEngine.from_engine_config(engine_config, specs_checked=True)
        self.app = build_app(self.engine, served_name, max_request_bytes=max_request_bytes,
                             config=engine_config)
        ctx = serve.get_replica_context()
        rank = getattr(ctx, "rank", None)
        self.label = str(getattr(rank, "rank", rank)) if rank is not None else ctx.replica_id.unique_id
        self.board = _board(ctx.app_name)
        self._reporter = asyncio.get_running_loop().create_task(self._report_loop())

    async def _report_loop(self) -> None:
        while True:
            try:
                await self.board.report.remote(self.label, os.getpid(),
                                               self.engine.metrics.render().decode())
            except Exception:  # the board may be restarting; the next report fixes it
                logger.exception("reporting metrics to the board")
            await asyncio.sleep(REPORT_INTERVAL_S)

    async def handle_request(self, request: dict) -> AsyncIterator[Any]:
        """Yields "accepted" (the request reached this replica), ("start", status,
        content_type), then body chunks."""
        from pagedserve.serving.asgi_bridge import call_asgi
        yield "accepted"
        async for item in call_asgi(self.app, request["method"], request["path"], request["body"]):
            yield item

    def check_health(self) -> None:
        if not self.engine.is_running:
            raise RuntimeError("the engine loop has stopped")


class RayReplicaPool:
    """The front end's view of the EngineReplica deployment (routing is Ray's, with our router)."""

    backend = "ray"

    def __init__(self, handle: Any, app_name: str) -> None:
        self.handle = handle.options(stream=True)
        self.app_name = app_name
        self.board = _board(app_name)

    async def start(self) -> None:
        pass

    async def stop(self) -> None:
        pass

    async def forward(self, method: str, path: str, body: bytes,
                      prefix_hashes: Sequence[bytes]) -> ReplicaResponse:
        request = {"method": method, "path": path, "body": body,
                   "prefix_hashes": [h.hex() for h in prefix_hashes]}
        for _ in range(3):  # a replica that died before accepting never ran the request
            gen = self.handle.handle_request.remote(request)
            try:
                if await gen.__anext__() == "accepted":
                    break
            except (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError):
                continue
        else:
            raise NoReplicaAvailable("no replica accepted the request; retry later")
        try:
            _, status, content_type = await gen.__anext__()
        except Exception as e:
            raise ReplicaFailed(f"the replica failed while serving this request: {type(e).__name__}") from None
        if content_type.startswith("text/event-stream"):
            return ReplicaResponse(status, content_type, self._stream(gen))
        try:
            data = b"".join([c async for c in gen])
        except Exception as e:
            raise ReplicaFailed(f"the replica failed while serving this request: {type(e).__name__}") from None
        return ReplicaResponse(status, content_type, one_chunk(data))

    @staticmethod
    async def _stream(gen) -> AsyncIterator[bytes]:
        try:
            async for chunk in gen:
                yield chunk
        except Exception as e:
            err = APIError(f"the replica failed while serving this request: {type(e).__name__}",
                           503, type="server_error", code="replica_failed")
            yield (error_event(err) + SSE_DONE).encode()
        finally:
            gen.cancel()  # no-op when finished; aborts the request when the client left

    async def _fresh(self) -> dict:
        return await self.board.fresh.remote(STALE_AFTER_S)

    async def health(self) -> dict:
        fresh = await self._fresh()
        status = (await asyncio.to_thread(serve.status)).applications.get(self.app_name)
        dep = status.deployments.get(ENGINE_DEPLOYMENT) if status else None
        states = {str(k.value if hasattr(k, "value") else k): v
                  for k, v in (dep.replica_states.items() if dep else [])}
        running = states.get("RUNNING", 0)
        all_running = dep is not None and running == sum(states.values()) and \
            str(getattr(dep.status, "value", dep.status)) == "HEALTHY"
        if not fresh or running == 0:
            verdict = "down"
        elif all_running and len(fresh) >= running:
            verdict = "ok"
        else:
            verdict = "degraded"
        return {"status": verdict, "backend": self.backend, "live_replicas": len(fresh),
                "replica_states": states,
                "replicas": [{"replica": k, "pid": v[1]} for k, v in sorted(fresh.items())]}

    async def metrics_texts(self) -> dict[str, str]:
        return {k: v[2] for k, v in (await self._fresh()).items()}

    def router_metrics(self) -> list:
        return []


def _ingress_deployment(frontend: dict):
    """The front end as a Serve ingress; frontend holds its settings (plain data)."""
    def build():
        from pagedserve.serving.frontend import build_dp_app
        from pagedserve.serving.prefix_key import load_tokenizer
        app_name = serve.get_replica_context().app_name
        handle = serve.get_deployment_handle(ENGINE_DEPLOYMENT, app_name=app_name)
        config = EngineConfig(**frontend["config"])
        return build_dp_app(RayReplicaPool(handle, app_name), load_tokenizer(config),
                            config.block_size, api_key=frontend["api_key"],
                            max_request_bytes=frontend["max_request_bytes"], manage_pool=False,
                            chat_template_content_format=config.chat_template_content_format)

    @serve.deployment(name="PagedServeIngress", num_replicas=1, ray_actor_options={"num_cpus": 0},
                      max_ongoing_requests=INGRESS_MAX_ONGOING_REQUESTS,
                      graceful_shutdown_wait_loop_s=SHUTDOWN_POLL_S)
    @serve.ingress(build)
    class PagedServeIngress:
        def __init__(self, engine_replicas: Any) -> None:
            # Bound to the engine deployment only so that Serve deploys both as one app.
            pass

    return PagedServeIngress


def build_serve_app(config: EngineConfig, served_name: str, api_key: str | None,
                    max_request_bytes: int, num_replicas: int, routing_policy: str = "prefix",
                    imbalance_threshold: int = 8, min_replicas: int | None = None,
                    max_replicas: int | None = None, num_gpus_per_replica: float = 0.0,
                    autoscaling: dict | None = None):
    """The Serve application: ingress bound to N EngineReplicas (or min..max, autoscaled)."""
    config_dict = dataclasses.asdict(config)
    # The ingress cannot see the replicas' devices: an unset max_num_seqs bounds each replica's
    # queue at the small-device default (a GPU of >= 70 GiB batches up to 1024; set it to use that).
    max_seqs = config.max_num_seqs or SMALL_DEVICE_MAX_NUM_SEQS
    options: dict[str, Any] = dict(
        name=ENGINE_DEPLOYMENT,
        ray_actor_options={"num_cpus": 1, "num_gpus": num_gpus_per_replica},
        # Beyond max_num_seqs a replica only queues: let Ray hold the rest at the router.
        max_ongoing_requests=max_seqs,
        health_check_period_s=2.0, health_check_timeout_s=60.0,
        graceful_shutdown_wait_loop_s=SHUTDOWN_POLL_S,
        request_router_config=RequestRouterConfig(
            request_router_class="pagedserve.serving.ray_router:PrefixAffinityRequestRouter",
            request_router_kwargs={"policy": routing_policy,
                                   "imbalance_threshold": imbalance_threshold}))
    if min_replicas is not None:
        options["autoscaling_config"] = {"target_ongoing_requests": max(1, max_seqs // 2),
                                         **(autoscaling or {}),
                                         "min_replicas": min_replicas, "max_replicas": max_replicas}
    else:
        options["num_replicas"] = num_replicas
    engine = serve.deployment(**options)(EngineReplica)
    frontend = {"config": config_dict, "api_key": api_key, "max_request_bytes": max_request_bytes}
    return _ingress_deployment(frontend).bind(engine.bind(config_dict, served_name, max_request_bytes))


def app_builder(args: dict):
    """Import path for a Serve config / KubeRay RayService:
    `pagedserve.serving.ray_app:app_builder` with args {model, data_parallel_size,
    tensor_parallel_size, routing_policy, served_model_name, min_replicas, max_replicas,
    autoscaling_config (more Ray Serve autoscaling fields), ...EngineConfig fields}."""
    args = dict(args)
    dp = int(args.pop("data_parallel_size", 1))
    policy = args.pop("routing_policy", "prefix")
    name = args.pop("served_model_name", None) or args.get("model")
    api_key = args.pop("api_key", None) or os.environ.get("PAGEDSERVE_API_KEY")
    min_r, max_r = args.pop("min_replicas", None), args.pop("max_replicas", None)
    autoscaling = args.pop("autoscaling_config", None)
    config = EngineConfig(**args)
    gpus = float(config.tensor_parallel_size) if config.device != "cpu" else 0.0
    return build_serve_app(config, name, api_key, 1 << 20, dp, policy, min_replicas=min_r,
                           max_replicas=max_r, num_gpus_per_replica=gpus, autoscaling=autoscaling)


def run_ray_server(args: argparse.Namespace, config: EngineConfig, served_name: str,
                   api_key: str | None, policy: Any) -> int:
    """`pagedserve serve --data-parallel-backend ray`: deploy, then serve until interrupted."""
    from pagedserve.serving.dp_args import autoscaling_overrides
    started_here = args.ray_address is None
    if started_here:
        ray.init(include_dashboard=False)
    else:
        ray.init(address=args.ray_address)

    def stop(signum, frame):
        raise KeyboardInterrupt
    # After ray.init, which installs its own: a terminated server takes its app (and the
    # cluster it started) down with it.
    signal.signal(signal.SIGTERM, stop)
    try:
        gpus_in_cluster = ray.cluster_resources().get("GPU", 0)
        gpus = float(config.tensor_parallel_size) if config.device != "cpu" and gpus_in_cluster else 0.0
        app = build_serve_app(config, served_name, api_key, args.max_request_bytes,
                              args.data_parallel_size, policy.name,
                              args.routing_imbalance_threshold, args.min_replicas,
                              args.max_replicas, gpus, autoscaling_overrides(args))
        serve.start(http_options={"host": args.host, "port": args.port})
        serve.run(app, name=APP_NAME, route_prefix="/", blocking=False)
        logger.info("serving %s on Ray Serve at http://%s:%d/v1 (%s routing)", served_name,
                    args.host, args.port, policy.name)
        print(f"pagedserve: ready on http://{args.host}:{args.port}/v1", flush=True)
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        return 0
    finally:
        try:
            serve.delete(APP_NAME)
            ray.kill(ray.get_actor(_board_name(APP_NAME), namespace="serve"))
        except Exception:
            pass
        if started_here:
            serve.shutdown()
        ray.shutdown(wait_for_processes=True)
