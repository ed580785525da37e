"""The data-parallel flags of `pagedserve serve` and their checks (no imports of the servers)."""
from __future__ import annotations

import argparse

from pagedserve.serving.routing import ROUTING_POLICIES

DP_BACKENDS = ("mp", "ray")
# The mp replicas' own API key, if set here (else one is made per launch): read by the front
# end, its relay workers, and whoever calls a replica directly.
REPLICA_KEY_ENV = "PAGEDSERVE_REPLICA_API_KEY"


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
