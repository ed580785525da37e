"""`pagedserve bench serve`: replay a workload against any OpenAI-compatible server.

Requests are the workload's token-id prompts sent to /v1/completions with
max_tokens = output_len and ignore_eos, streamed, at Poisson arrival times (or all at
once for an infinite rate). Latencies are measured on the client: TTFT is the time to
the first streamed choice, TPOT the mean gap between the following tokens, e2e the
whole request. Output token counts come from the server's usage (stream_options).

Prompt token ids are drawn below the served model's vocabulary size and prompt + output
kept within its context: both from /v1/models (`vocab_size`, `max_model_len`), or from
--vocab-size / --tokenizer / --max-model-len for servers that do not report them.
--output writes through pagedserve.benchmark.results; its commit is this client's, and the
server (possibly another engine) is named only by its URL and the model it reported.
What a run's records say (percentiles, throughput, errors) is bench_stats.py's.
"""
from __future__ import annotations

import asyncio
import json
import math
import os
import shlex
import sys
import time
from dataclasses import asdict, dataclass
from typing import Any

import httpx
from tqdm import tqdm

from pagedserve.entrypoints.bench_client import bench_client, make_client, send_request
from pagedserve.entrypoints.bench_stats import PERCENTILES, RequestResult, summarize
from pagedserve.workloads import VOCAB_DRAW, WorkloadRequest, make_workload


@dataclass
class ServedModel:
    """What /v1/models says of the model under test (vocab_size and max_model_len when known)."""
    id: str
    vocab_size: int | None = None
    max_model_len: int | None = None


async def fetch_served_model(client: httpx.AsyncClient, base_url: str, headers: dict,
                             model: str | None) -> ServedModel:
    """The named model's card (or the first listed); a one-line ValueError when unreachable."""
    url = f"{base_url}/models"
    try:
        r = await client.get(url, headers=headers)
    except httpx.HTTPError as e:
        raise ValueError(f"base_url: cannot reach {url} ({type(e).__name__}: {e or 'no detail'}); "
                         "is the server running?") from None
    if r.status_code != 200:
        hint = " (pass --api-key)" if r.status_code == 401 else ""
        raise ValueError(f"base_url: GET {url} answered HTTP {r.status_code}{hint}: "
                         f"{r.text[:200].strip()}")
    try:
        data = r.json().get("data") or []
    except (json.JSONDecodeError, AttributeError):
        raise ValueError(f"base_url: GET {url} did not answer an OpenAI model list") from None
    if not data:
        raise ValueError(f"model: {url} lists no model; pass --model")
    card = next((c for c in data if c.get("id") == model), None) if model else data[0]
    if card is None:  # the server may still serve it under that name: trust the user
        return ServedModel(model)

    def positive(key: str) -> int | None:
        v = card.get(key)
        return v if isinstance(v, int) and v > 0 else None
    return ServedModel(card["id"], positive("vocab_size"), positive("max_model_len"))


def tokenizer_vocab_size(path: str) -> int:
    """len() of a local tokenizer: every id below it is one the tokenizer knows."""
    from transformers import AutoTokenizer
    try:
        return len(AutoTokenizer.from_pretrained(path, local_files_only=True))
    except (OSError, ValueError) as e:
        raise ValueError(f"tokenizer: cannot load a tokenizer from {path!r} ({e})") from None


# Descriptors a client process holds besides its connections (the interpreter, pipes, libraries).
FD_MARGIN = 64


def check_fd_limit(connections: int) -> None:
    """Raise this process's open-file limit to the hard one (fd_limit); a ValueError before any
    request is sent when `connections` open at once would still not fit, instead of requests
    failing with EMFILE midway."""
    from pagedserve.entrypoints.fd_limit import raise_fd_limit
    soft = raise_fd_limit()
    if 0 <= soft < connections + FD_MARGIN:
        raise ValueError(f"max_concurrency: {connections} connections at once need an open-file limit of at least "
                         f"{connections + FD_MARGIN}, this client process has {soft} (ulimit -n); lower "
                         "--max-concurrency or use more client processes")


async def _send_all(base_url: str, requests: list[WorkloadRequest], model: str,
                    api_key: str | None, max_concurrency: int | None, temperature: float,
                    timeout: float, progress: bool, retries: int = 0
                    ) -> tuple[list[RequestResult], float, float, float]:
    """Send every request at its arrival_time; (results, start, end, CPU seconds this process
    spent meanwhile), times on the monotonic clock."""
    cpu0 = time.process_time()
    check_fd_limit(min(len(requests), max_concurrency or len(requests)))
    base_url = base_url.rstrip("/")
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    sem = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    bar = tqdm(total=len(requests), desc="requests", unit="req", disable=not progress,
               file=sys.stderr)
    async with make_client(bench_client(), max_concurrency or len(requests) + 8, timeout) as client:

        async def send(req: WorkloadRequest) -> RequestResult:
            sent_at = time.perf_counter() - start
            res = await send_request(client, base_url, model, req, headers, temperature, retries)
            res.sent_at = sent_at
            return res

        async def one(req: WorkloadRequest) -> RequestResult:
            try:
                if sem is None:
                    return await send(req)
                async with sem:
                    return await send(req)
            finally:
                bar.update(1)

        start = time.perf_counter()
        tasks = []
        for req in requests:
            delay = start + req.arrival_time - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(req)))
        results = await asyncio.gather(*tasks)
        end = time.perf_counter()
    bar.close()
    return list(results), start, end, time.process_time() - cpu0


def _client_worker(conn, base_url: str, requests: list[WorkloadRequest], kwargs: dict,
                   go) -> None:
    """One client process of a multi-process run: ready, wait for go, send, return results."""
    try:
        conn.send("ready")
        go.wait()
        conn.send(asyncio.run(_send_all(base_url, requests, **kwargs)))
    except BaseException as e:  # the parent reports it; a worker must not hang the run
        conn.send(e if isinstance(e, Exception) else RuntimeError(repr(e)))
    finally:
        conn.close()


async def _send_all_processes(base_url: str, requests: list[WorkloadRequest], num_processes: int,
                              kwargs: dict) -> tuple[list[RequestResult], float, float, float]:
    """_send_all split over num_processes processes (request i to process i % K, arrival times
    kept), started together; results in request order, the union's start and end.

    One asyncio process parses 10-20k SSE events/s at most; K of them keep the client from
    being what a saturation benchmark measures. time.perf_counter is CLOCK_MONOTONIC on
    Linux, one clock for every process of the host. The processes are spawned: a script
    calling this needs the `if __name__ == "__main__"` guard."""
    import multiprocessing as mp
    ctx = mp.get_context("spawn")  # the parent may hold threads (tqdm, executors): no fork
    go = ctx.Event()
    procs, conns = [], []
    try:
        for k in range(num_processes):
            parent, child = ctx.Pipe(duplex=False)
            share = requests[k::num_processes]
            mine = dict(kwargs, progress=False)
            if max_c := kwargs.get("max_concurrency"):  # the bound holds for the whole client
                mine["max_concurrency"] = max_c // num_processes + (k < max_c % num_processes)
            p = ctx.Process(target=_client_worker, args=(child, base_url, share, mine, go),
                            daemon=True, name=f"bench-client-{k}")
            p.start()
            child.close()
            procs.append(p)
            conns.append(parent)

        def recv(conn, what: str):
            try:
                got = conn.recv()
            except EOFError:  # e.g. a main module without `if __name__ == "__main__"`
                raise RuntimeError(f"a client process exited {what} (spawned processes "
                                   "import the main module: is it guarded?)") from None
            if isinstance(got, Exception):
                raise RuntimeError(f"a client process failed {what}: {got!r}") from got
            return got
        for c in conns:
            await asyncio.to_thread(recv, c, "before it started")
        go.set()
        parts = [await asyncio.to_thread(recv, c, "while sending") for c in conns]
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
    results: list[RequestResult | None] = [None] * len(requests)
    start = min(p[1] for p in parts)
    for k, (res, own_start, _, _) in enumerate(parts):
        for r in res:  # send times from the union's start, not each process's own
            if r.sent_at is not None:
                r.sent_at += own_start - start
        results[k::num_processes] = res
    return results, start, max(p[2] for p in parts), sum(p[3] for p in parts)


async def run_benchmark(base_url: str, requests: list[WorkloadRequest], model: str,
                        api_key: str | None = None, max_concurrency: int | None = None,
                        temperature: float = 0.0, timeout: float = 3600.0,
                        progress: bool = False, num_processes: int = 1,
                        keep_itl: bool = False, retries: int = 0) -> dict[str, Any]:
    """Send every request at its arrival_time (seconds after start); returns the summary.

    The summary's requests are the per-request records (with their inter-token gaps when
    keep_itl) and start_monotonic the run's start on time.perf_counter's clock, from which
    their sent_at count. num_processes > 1 splits the requests over that many client
    processes; the summary is of the merged per-request records (percentiles over all of them,
    throughput over the union's wall time, from the first process's start to the last one's end).
    retries: see send_request; the summary's `retried` counts them (0 by default: a failure counts)."""
    if num_processes < 1:
        raise ValueError(f"num_processes must be >= 1, got {num_processes}")
    http_client = bench_client()  # a bad $PAGEDSERVE_BENCH_CLIENT fails here, before any request
    kwargs = dict(model=model, api_key=api_key, max_concurrency=max_concurrency,
                  temperature=temperature, timeout=timeout, progress=progress, retries=retries)
    # No more processes than requests, nor than requests allowed in flight.
    k = max(1, min(num_processes, len(requests), max_concurrency or len(requests)))
    if k == 1:
        results, start, end, cpu = await _send_all(base_url, requests, **kwargs)
    else:
        results, start, end, cpu = await _send_all_processes(base_url, requests, k, kwargs)
    summary = summarize(results, end - start)
    summary["model"] = model
    summary["num_client_processes"] = k
    summary["http_client"] = http_client
    # The client's own CPU while sending (all its processes): near num_processes x duration
    # means the client, not the server, set the pace.
    summary["client_cpu_s"] = cpu
    summary["requests"] = [{k: v for k, v in asdict(r).items() if keep_itl or k != "itl"} for r in results]
    summary["start_monotonic"] = start
    return summary


async def _describe_model(args: Any) -> ServedModel:
    """/v1/models, with the command line's overrides on top."""
    base_url = args.base_url.rstrip("/")
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    async with httpx.AsyncClient(timeout=httpx.Timeout(30.0)) as client:
        served = await fetch_served_model(client, base_url, headers, args.model)
    if args.vocab_size is not None:
        served.vocab_size = args.vocab_size
    elif args.tokenizer is not None:
        served.vocab_size = tokenizer_vocab_size(args.tokenizer)
    if args.max_model_len is not None:
        served.max_model_len = args.max_model_len
    if served.vocab_size is None:
        raise ValueError(f"vocab_size: {base_url}/models does not report the model's vocabulary "
                         "size; pass --vocab-size N or --tokenizer DIR so that prompt token ids "
                         "are valid")
    return served


def salt_prompts(requests: list[WorkloadRequest], salt: int, draw: int) -> None:
    """Shift every prompt's first token id by `salt` (mod `draw`), in place: the same lengths and
    outputs, but no block of one run's prompts hashes like another run's, so several runs against
    one server each start with a cold prefix cache (the same seed draws the same prompts)."""
    if salt % draw:
        for req in requests:
            if req.prompt_token_ids:
                req.prompt_token_ids[0] = (req.prompt_token_ids[0] + salt) % draw


def format_summary(s: dict[str, Any]) -> str:
    lines = [
        f"{'completed / failed':<28}{s['completed']} / {s['failed']}",
        f"{'duration (s)':<28}{s['duration_s']:.2f}",
        f"{'input / output tokens':<28}{s['total_input_tokens']} / {s['total_output_tokens']}",
        f"{'request throughput (req/s)':<28}{s['request_throughput']:.2f}",
        f"{'output throughput (tok/s)':<28}{s['output_throughput']:.1f}",
        f"{'total throughput (tok/s)':<28}{s['total_token_throughput']:.1f}",
    ]
    for key, name in (("ttft_ms", "TTFT"), ("tpot_ms", "TPOT"), ("itl_ms", "ITL"),
                      ("e2e_latency_ms", "e2e")):
        d = s[key]
        lines.append(f"{name + ' (ms)':<28}mean {d['mean']:.1f}  " +
                     "  ".join(f"p{p} {d[f'p{p}']:.1f}" for p in PERCENTILES))
    return "\n".join(lines)


def _json_safe(x: Any) -> Any:
    """NaN (a statistic of no samples) becomes null: strict JSON readers reject NaN."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: _json_safe(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_json_safe(v) for v in x]
    return x


def run_serve_cli(args: Any) -> int:
    if args.num_requests is not None and args.num_requests < 1:
        raise ValueError(f"num_requests must be >= 1, got {args.num_requests}")
    if not args.request_rate > 0:
        raise ValueError(f"request_rate must be > 0 (inf: all at once), got {args.request_rate}")
    max_concurrency = getattr(args, "max_concurrency", None)
    if max_concurrency is not None and max_concurrency < 1:
        raise ValueError(f"max_concurrency must be >= 1, got {max_concurrency}")
    if args.output:
        from pagedserve.benchmark.results import git_commit
        git_commit()  # refuse before measuring, not after
    args.api_key = args.api_key or os.environ.get("PAGEDSERVE_API_KEY")
    served = asyncio.run(_describe_model(args))
    seed = getattr(args, "seed", 0)
    requests = make_workload(args.workload, args.num_requests, args.request_rate, seed=seed,
                             vocab_size=served.vocab_size, max_total_len=served.max_model_len)
    prompt_salt = getattr(args, "prompt_salt", 0)
    salt_prompts(requests, prompt_salt, min(VOCAB_DRAW, served.vocab_size))
    json_schemas = getattr(args, "json_schemas", 0)
    if json_schemas:
        from pagedserve.benchmark.json_schemas import schema_per_request
        for req, schema in zip(requests, schema_per_request(len(requests), json_schemas)):
            req.extra_body = {"structured_outputs": {"json": schema}}
    print(f"{len(requests)} {args.workload} requests to {served.id!r} at {args.base_url} (token ids "
          f"< {min(VOCAB_DRAW, served.vocab_size)}, prompt + output <= "
          f"{max(len(r.prompt_token_ids) + r.output_len for r in requests)})", file=sys.stderr)
    summary = asyncio.run(run_benchmark(
        args.base_url, requests, model=served.id, api_key=args.api_key,
        max_concurrency=max_concurrency, temperature=getattr(args, "temperature", 0.0),
        progress=not getattr(args, "disable_tqdm", False),
        num_processes=getattr(args, "num_client_processes", 1)))
    rate = args.request_rate if math.isfinite(args.request_rate) else "inf"
    config = {"base_url": args.base_url, "workload": args.workload,
              "num_requests": len(requests), "request_rate": rate,
              "max_concurrency": max_concurrency, "seed": seed,
              "num_client_processes": getattr(args, "num_client_processes", 1),
              "vocab_size": served.vocab_size, "max_model_len": served.max_model_len,
              "json_schemas": json_schemas, "prompt_salt": prompt_salt}
    print(format_summary(summary))
    errors = [r["error"] for r in summary["requests"] if r["error"]]
    if errors:
        print(f"{len(errors)} requests failed ({summary['errors']}); first error: {errors[0]}", file=sys.stderr)
    if args.output:
        from pagedserve.benchmark.results import write_result
        write_result(args.output, "serve", "pagedserve " + shlex.join(sys.argv[1:]), config, _json_safe(summary),
                     device=f"the server at {args.base_url} (measured from the client)")
        print(f"wrote {args.output}", file=sys.stderr)
    return 0 if summary["failed"] == 0 else 1
