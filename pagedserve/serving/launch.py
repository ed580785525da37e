"""`pagedserve serve --data-parallel-size N`: flags, replica placement, and start-up.

DP x TP on one host (mp): replica i gets GPUs [i*TP, (i+1)*TP) of the visible ones through
CUDA_VISIBLE_DEVICES; on CPU every replica runs on the CPU.
"""
from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import sys
from typing import Any

from pagedserve.config import EngineConfig
from pagedserve.entrypoints.http_stack import SERVER_KEEP_ALIVE_S
from pagedserve.serving.routing import ROUTING_POLICIES, make_policy

logger = logging.getLogger("pagedserve.dp")

DP_BACKENDS = ("mp", "ray")


def add_dp_args(parser: argparse.ArgumentParser) -> None:
    """The data-parallel flags of `pagedserve serve` (vLLM's names where vLLM has one)."""
    g = parser.add_argument_group("data parallel")
    g.add_argument("--data-parallel-size", type=int, default=1,
                   help="engine replicas behind the one endpoint, each with its own KV cache")
    g.add_argument("--data-parallel-backend", default="mp", choices=DP_BACKENDS,
                   help="mp: local processes; ray: Ray Serve deployments on a Ray cluster")
    g.add_argument("--routing-policy", default="prefix", choices=ROUTING_POLICIES,
                   help="prefix: the replica holding the request's prefix, unless its queue is "
                        "too long; round-robin: replicas in turn")
    g.add_argument("--routing-imbalance-threshold", type=int, default=8,
                   help="prefix routing leaves a prefix's replica when it has more than this "
                        "many requests in flight above the least-loaded replica")
    g.add_argument("--api-server-count", type=int, default=1,
                   help="mp backend: front-end processes on the one port, relaying in parallel; "
                        "routing stays in the first (see serving/relay_worker.py)")
    g.add_argument("--ray-address", default=None,
                   help="Ray cluster to join (ray backend; default: start a local one)")
    g.add_argument("--min-replicas", type=int, default=None,
                   help="ray backend: autoscale between --min-replicas and --max-replicas")
    g.add_argument("--max-replicas", type=int, default=None,
                   help="ray backend: the most replicas autoscaling may start")
    g.add_argument("--ray-autoscaling-config", default=None, metavar="JSON",
                   help="ray backend with --min/--max-replicas: more Ray Serve autoscaling_config "
                        "fields as a JSON object, e.g. '{\"upscale_delay_s\": 10, "
                        "\"downscale_delay_s\": 120}' (default target_ongoing_requests: "
                        "max_num_seqs / 2)")


def wants_dp(args: argparse.Namespace) -> bool:
    return getattr(args, "data_parallel_size", 1) != 1 or \
        getattr(args, "data_parallel_backend", "mp") == "ray"


def check_dp_args(args: argparse.Namespace) -> None:
    if args.data_parallel_size < 1:
        raise ValueError(f"data_parallel_size must be >= 1, got {args.data_parallel_size}")
    if args.api_server_count < 1:
        raise ValueError(f"api_server_count must be >= 1, got {args.api_server_count}")
    if args.api_server_count > 1 and args.data_parallel_backend != "mp":
        raise ValueError("api_server_count > 1 is for --data-parallel-backend mp (Ray Serve runs its own proxies)")
    if args.routing_imbalance_threshold < 0:
        raise ValueError(f"routing_imbalance_threshold must be >= 0, got "
                         f"{args.routing_imbalance_threshold}")
    if (args.min_replicas is None) != (args.max_replicas is None):
        raise ValueError("min_replicas and max_replicas go together")
    if args.min_replicas is not None:
        if args.data_parallel_backend != "ray":
            raise ValueError("min_replicas/max_replicas (autoscaling) need --data-parallel-backend ray")
        if not 1 <= args.min_replicas <= args.max_replicas:
            raise ValueError(f"need 1 <= min_replicas <= max_replicas, got {args.min_replicas} "
                             f"and {args.max_replicas}")
    autoscaling_overrides(args)


def autoscaling_overrides(args: argparse.Namespace) -> dict:
    """--ray-autoscaling-config as a dict ({} when not given); ValueError when malformed."""
    text = getattr(args, "ray_autoscaling_config", None)
    if text is None:
        return {}
    if args.min_replicas is None:
        raise ValueError("ray_autoscaling_config needs --min-replicas and --max-replicas")
    import json
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"ray_autoscaling_config: not JSON ({e})") from None
    if not isinstance(value, dict):
        raise ValueError("ray_autoscaling_config: must be a JSON object")
    for key in ("min_replicas", "max_replicas"):
        if key in value:
            raise ValueError(f"ray_autoscaling_config: set {key} with --{key.replace('_', '-')}")
    return value


def engine_flags(config: EngineConfig) -> list[str]:
    """The `pagedserve serve` flags that rebuild config (less the model) in a replica."""
    out: list[str] = []
    for f in dataclasses.fields(EngineConfig):
        if f.name in ("model", "extra"):
            continue
        value = getattr(config, f.name)
        flag = "--" + f.name.replace("_", "-")
        if isinstance(value, bool):
            out.append(flag if value else "--no-" + flag[2:])
        elif isinstance(value, list):  # list[int] flags take their values one argument each
            out += [flag, *map(str, value)]
        elif value is not None:
            out += [flag, str(value)]
    return out


def gpu_groups(dp: int, tp: int, device: str) -> list[str | None]:
    """CUDA_VISIBLE_DEVICES of each replica; None on CPU (nothing to partition)."""
    if device == "cpu":
        return [None] * dp
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        ids = [x for x in visible.split(",") if x.strip()]
    else:
        try:
            import torch
            ids = [str(i) for i in range(torch.cuda.device_count())]
        except Exception:
            ids = []
    if not ids:
        if device == "cuda":
            raise ValueError("device is cuda but no GPU is visible")
        return [None] * dp
    if dp * tp > len(ids):
        raise ValueError(f"data_parallel_size x tensor_parallel_size = {dp} x {tp} needs "
                         f"{dp * tp} GPUs, only {len(ids)} visible")
    return [",".join(ids[i * tp:(i + 1) * tp]) for i in range(dp)]


def replica_commands(config: EngineConfig, dp: int, served_name: str,
                     max_request_bytes: int) -> list[tuple[list[str], dict[str, str], int]]:
    from pagedserve.runner.dist_env import free_port
    groups = gpu_groups(dp, config.tensor_parallel_size, config.device)
    out = []
    for i in range(dp):
        port = free_port()
        cmd = [sys.executable, "-m", "pagedserve.entrypoints.cli", "serve", config.model,
               "--host", "127.0.0.1", "--port", str(port), "--served-model-name", served_name,
               "--max-request-bytes", str(max_request_bytes), *engine_flags(config)]
        env = dict(os.environ)
        env.pop("PAGEDSERVE_API_KEY", None)  # replicas listen on loopback only, keyless
        if groups[i] is not None:
            env["CUDA_VISIBLE_DEVICES"] = groups[i]
        out.append((cmd, env, port))
    return out


def tokenizer_path(config: EngineConfig) -> str | None:
    return None if config.skip_tokenizer_init else (config.tokenizer or config.model)


def load_tokenizer_path(path: str | None) -> Any:
    """The replicas' tokenizer, for routing keys; None without one (skip_tokenizer_init: then
    only token-id prompts have a key, text prompts are routed by load)."""
    if path is None:
        return None
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(path, local_files_only=True)


def load_tokenizer(config: EngineConfig) -> Any:
    return load_tokenizer_path(tokenizer_path(config))


def run_dp_server_cli(args: argparse.Namespace, config: EngineConfig, served_name: str,
                      api_key: str | None) -> int:
    """Serve N replicas of config behind one endpoint until interrupted."""
    import uvicorn

    from pagedserve.serving.frontend import build_dp_app

    check_dp_args(args)
    policy = make_policy(args.routing_policy, args.routing_imbalance_threshold)
    if args.data_parallel_backend == "ray":
        from pagedserve.serving.ray_app import run_ray_server
        return run_ray_server(args, config, served_name, api_key, policy)
    from pagedserve.serving.mp_pool import ProcessReplicaPool
    pool = ProcessReplicaPool(replica_commands(config, args.data_parallel_size, served_name,
                                               args.max_request_bytes), policy)
    hooks = {}
    if args.api_server_count > 1:
        from pagedserve.serving.relay_worker import relay_worker_hooks
        hooks = relay_worker_hooks(pool, args.api_server_count, args.host, args.port, tokenizer_path(config),
                                   config.block_size, args.max_request_bytes, api_key)
    app = build_dp_app(pool, load_tokenizer(config), config.block_size, api_key=api_key,
                       max_request_bytes=args.max_request_bytes, **hooks)
    logging.basicConfig(level=logging.INFO)
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per forwarded request
    from pagedserve.entrypoints.http_stack import describe
    logger.info("serving %s with %d replicas (mp, %s routing, relayed with %s by %d front-end process(es); %s) "
                "on http://%s:%d/v1", served_name, args.data_parallel_size, policy.name, pool.relay_client,
                args.api_server_count, describe(), args.host, args.port)
    if args.api_server_count == 1:
        uvicorn.run(app, host=args.host, port=args.port, log_level="info", timeout_keep_alive=SERVER_KEEP_ALIVE_S)
        return 0
    from pagedserve.serving.relay_worker import reuse_port_socket
    sock = reuse_port_socket(args.host, args.port)  # the relay workers bind the same port
    uvicorn.Server(uvicorn.Config(app, log_level="info", timeout_keep_alive=SERVER_KEEP_ALIVE_S)).run(sockets=[sock])
    return 0

