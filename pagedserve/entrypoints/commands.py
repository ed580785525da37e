"""Argument parsers of the subcommands; each handler imports its implementation lazily.

Every flag has help; the formatter appends its default, and argparse lists its choices.
Engine flags come from the EngineConfig fields (pagedserve.engine_args).
"""
from __future__ import annotations

import argparse
import math

from pagedserve.engine_args import add_engine_args
from pagedserve.workloads import WORKLOADS

WORKLOAD_NAMES = sorted(WORKLOADS)
SIM_ALLOCATORS = ["paged", "contiguous-max", "contiguous-pow2", "contiguous-oracle"]


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Defaults shown after each help text; None defaults ('not set') are left unsaid."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None or action.default is False and action.nargs == 0:
            return action.help
        return super()._get_help_string(action)


def _add(sub, name: str, help: str) -> argparse.ArgumentParser:
    return sub.add_parser(name, help=help, description=help, formatter_class=HelpFormatter)


def _at_least(minimum: float, kind: type = int):
    """argparse type: a number >= minimum, named in the error."""
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {kind.__name__}, got {text!r}") from None
        if not value >= minimum:  # also rejects NaN
            raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {text}")
        return value
    parse.__name__ = kind.__name__
    return parse


def port_number(text: str) -> int:
    """argparse type: a TCP port, 0 to 65535 (0: any free port)."""
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"must be in [0, 65535], got {port}")
    return port


def positive_rate(text: str) -> float:
    """argparse type: requests per second > 0; inf sends all at once."""
    try:
        rate = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number or inf, got {text!r}") from None
    if math.isnan(rate) or rate <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0 (inf: all at once), got {text}")
    return rate


def register_sim(sub) -> None:
    p = _add(sub, "sim", "replay a synthetic workload through the real scheduler, no weights")
    p.add_argument("--workload", default="sharegpt-like", choices=WORKLOAD_NAMES,
                   help="which synthetic request set to replay")
    p.add_argument("--allocator", default="paged", choices=SIM_ALLOCATORS,
                   help="paged KV cache, or one of the paper's contiguous baselines")
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV block, 1 to 1024")
    p.add_argument("--num-blocks", type=_at_least(1), default=None,
                   help="KV blocks (default: the paper's 15,700-token budget / block size)")
    p.add_argument("--num-requests", type=_at_least(1), default=None,
                   help="requests to draw (default: the workload's own count)")
    p.add_argument("--request-rate", type=positive_rate, default=None,
                   help="Poisson arrivals per second (default: all at t=0)")
    p.add_argument("--max-num-seqs", type=_at_least(1), default=256, help="most sequences in one batch")
    p.add_argument("--max-model-len", type=_at_least(1), default=None,
                   help="longest prompt + output (default: the workload's cap)")
    p.add_argument("--seed", type=int, default=0, help="seed of the workload draw")
    p.add_argument("--model", default=None,
                   help="a model directory: step times from its config.json on an H200 (for a mixture of "
                        "experts, its active parameters and the experts each step touches) instead of "
                        "the paper's OPT-13B on an A100")
    p.add_argument("--output", default=None, help="write the JSON result here")
    p.add_argument("--dashboard", action="store_true",
                   help="instead of running to the end, serve the KV page map of the run at /dashboard "
                        "with play / pause / step (no model, no GPU)")
    p.add_argument("--host", default="127.0.0.1", help="with --dashboard: address to listen on")
    p.add_argument("--port", type=int, default=8001, help="with --dashboard: port to listen on")

    def run(args):
        if args.dashboard:
            from pagedserve.dashboard.sim_app import run_sim_dashboard
            return run_sim_dashboard(args)
        from pagedserve.sim import run_sim_cli
        return run_sim_cli(args)
    p.set_defaults(func=run)


def register_generate(sub) -> None:
    p = _add(sub, "generate", "generate completions for prompts given on the command line")
    p.add_argument("prompts", nargs="+", metavar="PROMPT", help="text prompts, one per argument")
    p.add_argument("--model", default=None, help="HF model directory (default: the bundled demo model)")
    p.add_argument("--max-tokens", type=int, default=64, help="most new tokens per completion")
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass, in (0, 1]")
    p.add_argument("--top-k", type=int, default=-1, help="sample among the k likeliest tokens (-1: all)")
    p.add_argument("--n", type=int, default=1, help="completions per prompt")
    add_engine_args(p)

    def run(args):
        from pagedserve.entrypoints.generate import run_generate_cli
        return run_generate_cli(args)
    p.set_defaults(func=run)


def register_serve(sub) -> None:
    p = _add(sub, "serve", "OpenAI-compatible HTTP server (completions, chat, models, metrics)")
    p.add_argument("model_pos", nargs="?", default=None, metavar="MODEL",
                   help="HF model directory (default: the bundled demo model)")
    p.add_argument("--model", default=None, help="the same as MODEL")
    p.add_argument("--served-model-name", default=None,
                   help="the name clients send as `model` (default: MODEL, or pagedserve-demo)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    p.add_argument("--port", type=port_number, default=8000, help="TCP port to listen on")
    p.add_argument("--api-key", default=None,
                   help="require `Authorization: Bearer KEY` on /v1/* (default: $PAGEDSERVE_API_KEY "
                        "if set, else no key; an empty key is an error)")
    p.add_argument("--max-request-bytes", type=_at_least(1), default=1 << 20,
                   help="larger request bodies are answered 413")
    p.add_argument("--allowed-hosts", nargs="+", default=None, metavar="HOST",
                   help="Host headers answered; others get 400 (DNS rebinding). '*': any; "
                        "'ip-address': any IP; '*.example.com': its subdomains (default: localhost "
                        "and --host; with a wildcard --host also this machine's names and any IP)")
    p.add_argument("--max-waiting-requests", type=_at_least(0), default=None,
                   help="requests that may wait beyond the max_num_seqs that run; more answer 503 "
                        "with Retry-After (default: the KV cache's size in blocks, at most 8 x "
                        "max_num_seqs and at least max_num_seqs)")
    p.add_argument("--shutdown-timeout", type=_at_least(0, float), default=10.0,
                   help="on SIGTERM/SIGINT, seconds requests in flight get to finish before they are "
                        "ended (streams: an error event and [DONE]; others: 503); a second signal "
                        "exits at once")
    p.add_argument("--disable-uvicorn-access-log", action="store_true",
                   help="do not log a line per HTTP request")
    p.add_argument("--uvicorn-log-level", default="info",
                   choices=("critical", "error", "warning", "info", "debug", "trace"),
                   help="the HTTP server's log level (vLLM's)")
    p.add_argument("--enable-log-requests", action="store_true",
                   help="log a line per request: its id, prompt length and sampling parameters (vLLM's)")
    p.add_argument("--disable-log-requests", action="store_true",
                   help="vLLM's older flag: requests are not logged, the default (kept so vLLM command lines run)")
    p.add_argument("--disable-log-stats", action="store_true",
                   help="no stats line every 10 s while the engine works (throughput, running and waiting "
                        "requests, KV cache usage, prefix hit rate; vLLM's, on by default)")
    p.add_argument("--enable-prompt-tokens-details", action="store_true",
                   help="usage.prompt_tokens_details.cached_tokens: the prompt tokens read from the prefix "
                        "cache (vLLM's)")
    p.add_argument("--return-tokens-as-token-ids", action="store_true",
                   help="logprobs name tokens \"token_id:N\" unless a request's return_tokens_as_token_ids "
                        "says otherwise (vLLM's)")
    from pagedserve.entrypoints.http_options import add_http_args
    add_http_args(p)
    add_engine_args(p)
    from pagedserve.serving.dp_args import add_dp_args  # hook (issue #15)
    add_dp_args(p)

    def run(args):
        from pagedserve.serving.launch import run_server_cli
        return run_server_cli(args)
    p.set_defaults(func=run)


def register_bench(sub) -> None:
    p = sub.add_parser("bench", help="benchmarks: throughput (offline) and serve (against any OpenAI URL)",
                       description="benchmarks: throughput (offline) and serve (against any OpenAI URL)")
    bsub = p.add_subparsers(dest="bench_command", required=True, metavar="BENCHMARK")

    def run_throughput(args):
        from pagedserve.benchmark.throughput import run_throughput_cli
        return run_throughput_cli(args)

    def run_serve(args):
        from pagedserve.entrypoints.bench_serve import run_serve_cli
        return run_serve_cli(args)

    t = _add(bsub, "throughput", "offline throughput of a workload, dummy weights of a real config")
    t.add_argument("--workload", default="nanovllm", choices=WORKLOAD_NAMES, help="request set to time")
    t.add_argument("--model", default=None,
                   help="HF model directory (default: the workload's config in benchmarks/models/)")
    t.add_argument("--num-requests", type=_at_least(1), default=None,
                   help="requests to draw (default: the workload's own count)")
    t.add_argument("--repeats", type=_at_least(1), default=2, help="timed runs; the best is reported")
    t.add_argument("--output", default=None, help="write the JSON result (and a .md table) here")
    t.add_argument("--disable-tqdm", action="store_true", help="no progress bar (finished requests and ETA)")
    add_engine_args(t)
    t.set_defaults(func=run_throughput)

    s = _add(bsub, "serve", "replay a workload against an OpenAI-compatible server")
    s.add_argument("--base-url", default="http://127.0.0.1:8000/v1", help="the server's /v1 URL")
    s.add_argument("--model", default=None, help="model name to send (default: the first of /v1/models)")
    s.add_argument("--workload", default="sharegpt-like", choices=WORKLOAD_NAMES, help="request set to replay")
    s.add_argument("--num-requests", type=_at_least(1), default=100, help="requests to send")
    s.add_argument("--request-rate", type=positive_rate, default=float("inf"),
                   help="Poisson arrivals per second (inf: all at once)")
    s.add_argument("--api-key", default=None,
                   help="sent as `Authorization: Bearer KEY` (default: $PAGEDSERVE_API_KEY if set)")
    s.add_argument("--max-concurrency", type=_at_least(1), default=None,
                   help="at most this many requests in flight")
    s.add_argument("--temperature", type=float, default=0.0, help="sampling temperature of every request")
    s.add_argument("--seed", type=int, default=0, help="workload draw seed (arrivals use seed + 1)")
    s.add_argument("--vocab-size", type=_at_least(1), default=None,
                   help="draw prompt token ids below this (default: vocab_size from /v1/models, "
                        "else the --tokenizer's size)")
    s.add_argument("--tokenizer", default=None,
                   help="local tokenizer directory whose size bounds the token ids, for servers "
                        "whose /v1/models has no vocab_size")
    s.add_argument("--max-model-len", type=_at_least(2), default=None,
                   help="cap prompt + output tokens (default: max_model_len from /v1/models)")
    s.add_argument("--num-client-processes", type=_at_least(1), default=1,
                   help="split the requests over this many client processes, so that the "
                        "client's SSE parsing does not bound the measurement; percentiles are "
                        "of the merged records (no progress bar when > 1)")
    s.add_argument("--json-schemas", type=int, default=0, metavar="N",
                   help="every request carries structured_outputs.json, one of a fixed set of N "
                        "schemas (pagedserve/benchmark/json_schemas.py) that never close before "
                        "max_tokens; 0: unconstrained")
    s.add_argument("--prompt-salt", type=int, default=0, metavar="N",
                   help="shift each prompt's first token id by N, so that runs with different N "
                        "share no cached prefix (the same seed draws the same prompts); 0: as drawn")
    s.add_argument("--disable-tqdm", action="store_true", help="no progress bar")
    s.add_argument("--output", default=None, help="write the JSON summary and every request here")
    s.set_defaults(func=run_serve)
