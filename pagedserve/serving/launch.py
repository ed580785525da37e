"""`pagedserve serve`: the one entry that picks the single engine, the mp front end or Ray.

DP x TP on one host (mp): replica i gets GPUs [i*TP, (i+1)*TP) of the visible ones through
CUDA_VISIBLE_DEVICES; on CPU every replica runs on the CPU. The mp replicas listen on loopback
and take a key of their own, made per launch ($PAGEDSERVE_REPLICA_API_KEY if set: tests and
operators who call a replica directly): no other local process can use them.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import secrets
import sys
from typing import Any

from pagedserve.config import EngineConfig
from pagedserve.serving.dp_args import (DP_BACKENDS, REPLICA_KEY_ENV, add_dp_args,  # noqa: F401
                                        autoscaling_overrides, check_dp_args, wants_dp)
from pagedserve.serving.prefix_key import load_tokenizer, load_tokenizer_path, tokenizer_path  # noqa: F401
from pagedserve.serving.routing import make_policy

logger = logging.getLogger("pagedserve.dp")


def replica_api_key() -> str:
    return os.environ.get(REPLICA_KEY_ENV) or "sk-replica-" + secrets.token_urlsafe(24)


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
        elif isinstance(value, dict):  # the flag reads JSON (engine_args), not a Python repr
            out += [flag, json.dumps(value)]
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


def replica_commands(config: EngineConfig, dp: int, served_name: str, max_request_bytes: int,
                     replica_key: str, server_flags: list[str] = ()) -> list[tuple[list[str], dict[str, str], int]]:
    """server_flags: the `serve` flags (not engine flags) every replica takes as given."""
    from pagedserve.runner.dist_env import free_port
    groups = gpu_groups(dp, config.tensor_parallel_size, config.device)
    out = []
    for i in range(dp):
        port = free_port()
        cmd = [sys.executable, "-m", "pagedserve.entrypoints.cli", "serve", config.model,
               "--host", "127.0.0.1", "--port", str(port), "--served-model-name", served_name,
               "--max-request-bytes", str(max_request_bytes), *server_flags, *engine_flags(config)]
        env = dict(os.environ)
        # Loopback only, and a key of their own (through the environment, never argv).
        env["PAGEDSERVE_API_KEY"] = replica_key
        if groups[i] is not None:
            env["CUDA_VISIBLE_DEVICES"] = groups[i]
        out.append((cmd, env, port))
    return out


def _server_flags(args: argparse.Namespace) -> list[str]:
    """The replica-side `serve` flags of the front end's command line."""
    out = ["--shutdown-timeout", str(args.shutdown_timeout), "--uvicorn-log-level", args.uvicorn_log_level]
    if args.max_waiting_requests is not None:
        out += ["--max-waiting-requests", str(args.max_waiting_requests)]
    for flag in ("enable_log_requests", "disable_log_stats", "return_tokens_as_token_ids",
                 "enable_prompt_tokens_details"):
        if getattr(args, flag):
            out.append("--" + flag.replace("_", "-"))
    return out


def run_dp_server_cli(args: argparse.Namespace, config: EngineConfig, served_name: str,
                      api_key: str | None) -> int:
    """Serve N replicas of config behind one endpoint until interrupted."""
    from pagedserve.entrypoints.http_options import add_cors, http_argv, scheme, uvicorn_options
    from pagedserve.entrypoints.http_server import make_server
    from pagedserve.entrypoints.openai.middleware import default_allowed_hosts
    from pagedserve.serving.frontend import build_dp_app

    check_dp_args(args)
    policy = make_policy(args.routing_policy, args.routing_imbalance_threshold)
    if args.data_parallel_backend == "ray":
        asked = [f for f in ("enable_log_requests", "return_tokens_as_token_ids", "enable_prompt_tokens_details")
                 if getattr(args, f)]
        if asked:
            raise ValueError(f"--{asked[0].replace('_', '-')} is not supported with --data-parallel-backend ray yet "
                             "(mp replicas take it)")
        from pagedserve.serving.ray_app import run_ray_server
        return run_ray_server(args, config, served_name, api_key, policy)
    from pagedserve.serving.mp_pool import ProcessReplicaPool
    replica_key = replica_api_key()
    pool = ProcessReplicaPool(replica_commands(config, args.data_parallel_size, served_name,
                                               args.max_request_bytes, replica_key, _server_flags(args)),
                              policy, replica_key=replica_key)
    allowed = args.allowed_hosts or default_allowed_hosts(args.host)
    hooks = {}
    if args.api_server_count > 1:
        from pagedserve.serving.relay_worker import relay_worker_hooks
        hooks = relay_worker_hooks(pool, args.api_server_count, args.host, args.port, tokenizer_path(config),
                                   config.block_size, args.max_request_bytes, api_key, replica_key,
                                   allowed, args.shutdown_timeout, config.chat_template, http_argv(args),
                                   config.chat_template_content_format)
    app = build_dp_app(pool, load_tokenizer(config), config.block_size, api_key=api_key,
                       max_request_bytes=args.max_request_bytes, allowed_hosts=allowed,
                       chat_template_content_format=config.chat_template_content_format, **hooks)
    add_cors(app, args)
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per forwarded request
    from pagedserve.entrypoints.http_stack import describe
    logger.info("serving %s with %d replicas (mp, %s routing, relayed with %s by %d front-end process(es); %s) "
                "on %s://%s:%d/v1", served_name, args.data_parallel_size, policy.name, pool.relay_client,
                args.api_server_count, describe(), scheme(args), args.host, args.port)
    server = make_server(app, args.host, args.port, shutdown_timeout=args.shutdown_timeout,
                         on_drain_timeout=app.state.drain.expire,
                         access_log=not args.disable_uvicorn_access_log, log_level=args.uvicorn_log_level,
                         **uvicorn_options(args))
    if args.api_server_count == 1:
        server.run()
        return 0
    from pagedserve.serving.relay_worker import reuse_port_socket
    sock = reuse_port_socket(args.host, args.port)  # the relay workers bind the same port
    server.run(sockets=[sock])
    return 0


DEMO_MODEL_NAME = "pagedserve-demo"


def _check_can_listen(host: str, port: int) -> None:
    """A taken port is a one-line error before the model loads, not a bind failure after."""
    import socket
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
        with socket.socket(family, socket.SOCK_STREAM) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
            s.bind((host, port))
    except OSError as e:
        raise ValueError(f"port: cannot listen on {host}:{port} ({e.strerror or e})") from None


def resolve_api_key(args: argparse.Namespace) -> str | None:
    """--api-key, else $PAGEDSERVE_API_KEY, else none; an empty key is an error, not 'no auth'."""
    if args.api_key is not None:
        if not args.api_key.strip():
            raise ValueError("api_key: empty; give a non-empty key, or leave --api-key out to serve without one")
        return args.api_key
    env = os.environ.get("PAGEDSERVE_API_KEY")
    if env is not None and not env.strip():
        raise ValueError("PAGEDSERVE_API_KEY is set but empty; unset it to serve without a key")
    return env


def run_server_cli(args: Any) -> int:
    """`pagedserve serve`: build the engine config from the flags, then serve it with one engine,
    mp replicas or Ray."""
    from pagedserve.engine_args import engine_config_from_args

    if args.model_pos and args.model and args.model_pos != args.model:
        raise ValueError(f"MODEL ({args.model_pos!r}) and --model ({args.model!r}) disagree")
    model = args.model_pos or args.model
    default_name = model
    if model is None:
        try:
            from pagedserve.demo_model import DEMO_MODEL_DIR
        except ImportError:
            raise ValueError("no MODEL given and the bundled demo model is not installed") from None
        model, default_name = str(DEMO_MODEL_DIR), DEMO_MODEL_NAME
    if args.max_request_bytes < 1:
        raise ValueError(f"max_request_bytes must be >= 1, got {args.max_request_bytes}")
    if args.enable_log_requests and args.disable_log_requests:
        raise ValueError("--enable-log-requests and --disable-log-requests contradict each other")
    from pagedserve.entrypoints.http_options import asks_http_options, check_http_args
    check_http_args(args)
    http_flags = asks_http_options(args)
    if http_flags and wants_dp(args) and args.data_parallel_backend == "ray":
        raise ValueError(f"{http_flags[0]} is not supported with --data-parallel-backend ray yet (mp takes it)")
    api_key = resolve_api_key(args)
    config = engine_config_from_args(args, model)
    from pagedserve.engine.preflight import check_engine_config
    check_engine_config(config)  # before any process starts: one line, in seconds
    from pagedserve.log_setup import configure_logging
    configure_logging("api-server")
    _check_can_listen(args.host, args.port)
    # Each connection is a file descriptor: at the soft limit uvloop resets new connections
    # (clients see httpx ReadError). Raised before the engine core and DP replicas start, so
    # they inherit it; the relay workers raise their own.
    from pagedserve.entrypoints.fd_limit import fd_limit_note, raise_fd_limit
    logger.debug("%s", fd_limit_note(raise_fd_limit()))
    name = args.served_model_name or default_name
    if wants_dp(args):
        return run_dp_server_cli(args, config, name, api_key)
    if getattr(args, "api_server_count", 1) != 1:
        raise ValueError("api_server_count > 1 needs --data-parallel-size > 1 (the front end's relay processes)")
    from pagedserve.entrypoints.openai.api_server import run_single_server
    return run_single_server(args, config, name, api_key)
