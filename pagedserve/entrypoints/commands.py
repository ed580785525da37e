"""Argument parsers of the subcommands; each handler imports its implementation lazily."""
from __future__ import annotations



def register_sim(sub) -> None:
    p = sub.add_parser("sim", help="replay a synthetic workload through the real scheduler, no weights")
    p.add_argument("--workload", default="sharegpt-like",
                   choices=["sharegpt-like", "alpaca-like", "nanovllm", "fixed256", "shared-prefix"])
    p.add_argument("--allocator", default="paged",
                   choices=["paged", "contiguous-max", "contiguous-pow2", "contiguous-oracle"])
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-blocks", type=int, default=None)
    p.add_argument("--num-requests", type=int, default=None)
    p.add_argument("--request-rate", type=float, default=None, help="Poisson arrivals per second (default: all at t=0)")
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output", default=None, help="write the JSON result here")

    def run(args):
        from pagedserve.sim import run_sim_cli
        return run_sim_cli(args)
    p.set_defaults(func=run)


def register_generate(sub) -> None:
    from pagedserve.entrypoints.cli import add_engine_args
    p = sub.add_parser("generate", help="generate completions for prompts given on the command line")
    p.add_argument("prompts", nargs="+")
    p.add_argument("--model", default=None, help="HF model directory (default: the bundled demo model)")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=-1)
    p.add_argument("--n", type=int, default=1)
    add_engine_args(p)

    def run(args):
        from pagedserve.entrypoints.generate import run_generate_cli
        return run_generate_cli(args)
    p.set_defaults(func=run)


def register_serve(sub) -> None:
    from pagedserve.entrypoints.cli import add_engine_args
    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    p.add_argument("model_pos", nargs="?", default=None, metavar="MODEL")
    p.add_argument("--model", default=None)
    p.add_argument("--served-model-name", default=None)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=None)
    p.add_argument("--max-request-bytes", type=int, default=1 << 20)
    add_engine_args(p)
    from pagedserve.serving.launch import add_dp_args  # hook (issue #15)
    add_dp_args(p)

    def run(args):
        from pagedserve.entrypoints.openai.api_server import run_server_cli
        return run_server_cli(args)
    p.set_defaults(func=run)


def register_bench(sub) -> None:
    p = sub.add_parser("bench", help="benchmarks: throughput (offline) and serve (against any OpenAI URL)")
    bsub = p.add_subparsers(dest="bench_command", required=True)

    def run_throughput(args):
        from pagedserve.benchmark.throughput import run_throughput_cli
        return run_throughput_cli(args)

    def run_serve(args):
        from pagedserve.entrypoints.bench import run_serve_cli
        return run_serve_cli(args)

    from pagedserve.entrypoints.cli import add_engine_args
    t = bsub.add_parser("throughput", help="offline throughput of a workload")
    t.add_argument("--workload", default="nanovllm")
    t.add_argument("--model", default=None)
    t.add_argument("--num-requests", type=int, default=None)
    t.add_argument("--repeats", type=int, default=2)
    t.add_argument("--output", default=None)
    add_engine_args(t)
    t.set_defaults(func=run_throughput)

    s = bsub.add_parser("serve", help="replay a workload against an OpenAI-compatible server")
    s.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    s.add_argument("--model", default=None)
    s.add_argument("--workload", default="sharegpt-like")
    s.add_argument("--num-requests", type=int, default=100)
    s.add_argument("--request-rate", type=float, default=float("inf"))
    s.add_argument("--api-key", default=None)
    s.add_argument("--max-concurrency", type=int, default=None, help="at most this many requests in flight")
    s.add_argument("--temperature", type=float, default=0.0)
    s.add_argument("--seed", type=int, default=0, help="workload draw seed (arrivals use seed + 1)")
    s.add_argument("--output", default=None)
    s.set_defaults(func=run_serve)
