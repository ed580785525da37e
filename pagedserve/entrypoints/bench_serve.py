"""`pagedserve bench serve`: replay a workload against any OpenAI-compatible server.

Requests are the workload's token-id prompts sent to /v1/completions with
max_tokens = output_len and ignore_eos, streamed, at Poisson arrival times (or all at
once for an infinite rate). Latencies are measured on the client: TTFT is the time to
the first streamed choice, TPOT the mean gap between the following tokens, e2e the
whole request. Output token counts come from the server's usage (stream_options).
--output writes through pagedserve.benchmark.results; its commit is this client's, and the
server (possibly another engine) is named only by its URL and the model it reported.
"""
from __future__ import annotations

import asyncio
import json
import math
import shlex
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import httpx
import numpy as np

from pagedserve.workloads import WorkloadRequest, make_workload

PERCENTILES = (50, 90, 99)


@dataclass
class RequestResult:
    prompt_len: int
    expected_output_len: int
    output_len: int = 0
    ttft: float | None = None
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)
    error: str | None = None

    @property
    def tpot(self) -> float | None:
        if self.ttft is None or self.output_len < 2:
            return None
        return (self.latency - self.ttft) / (self.output_len - 1)


async def send_request(client: httpx.AsyncClient, base_url: str, model: str, req: WorkloadRequest,
                       headers: dict, temperature: float) -> RequestResult:
    res = RequestResult(prompt_len=len(req.prompt_token_ids), expected_output_len=req.output_len)
    payload = {"model": model, "prompt": req.prompt_token_ids, "max_tokens": req.output_len,
               "temperature": temperature, "ignore_eos": True, "stream": True,
               "stream_options": {"include_usage": True}}
    start = last = time.perf_counter()
    chunks_with_text = 0
    try:
        async with client.stream("POST", f"{base_url}/completions", json=payload,
                                 headers=headers) as r:
            if r.status_code != 200:
                res.error = f"HTTP {r.status_code}: {(await r.aread()).decode(errors='replace')[:300]}"
                return res
            async for line in r.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    res.error = json.dumps(chunk["error"])[:300]
                    break
                now = time.perf_counter()
                if chunk.get("choices"):
                    chunks_with_text += 1
                    if res.ttft is None:
                        res.ttft = now - start
                    else:
                        res.itl.append(now - last)
                    last = now
                if chunk.get("usage"):
                    res.output_len = int(chunk["usage"].get("completion_tokens") or 0)
    except (httpx.HTTPError, json.JSONDecodeError) as e:
        res.error = f"{type(e).__name__}: {e}"
    res.latency = time.perf_counter() - start
    if res.output_len == 0:  # server without usage in streams: one token per chunk
        res.output_len = chunks_with_text
    return res


def _stats(values: list[float], scale: float = 1000.0) -> dict[str, float]:
    """mean / median / pNN of a latency list, in milliseconds."""
    if not values:
        return {"mean": math.nan, **{f"p{p}": math.nan for p in PERCENTILES}}
    a = np.asarray(values) * scale
    return {"mean": float(a.mean()), **{f"p{p}": float(np.percentile(a, p)) for p in PERCENTILES}}


def summarize(results: list[RequestResult], duration: float) -> dict[str, Any]:
    ok = [r for r in results if r.error is None]
    out_tokens = sum(r.output_len for r in ok)
    in_tokens = sum(r.prompt_len for r in ok)
    return {
        "duration_s": duration,
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "total_input_tokens": in_tokens,
        "total_output_tokens": out_tokens,
        "request_throughput": len(ok) / duration if duration > 0 else math.nan,
        "output_throughput": out_tokens / duration if duration > 0 else math.nan,
        "total_token_throughput": (in_tokens + out_tokens) / duration if duration > 0 else math.nan,
        "ttft_ms": _stats([r.ttft for r in ok if r.ttft is not None]),
        "tpot_ms": _stats([r.tpot for r in ok if r.tpot is not None]),
        "itl_ms": _stats([x for r in ok for x in r.itl]),
        "e2e_latency_ms": _stats([r.latency for r in ok]),
    }


async def resolve_model(client: httpx.AsyncClient, base_url: str, headers: dict) -> str:
    r = await client.get(f"{base_url}/models", headers=headers)
    r.raise_for_status()
    data = r.json().get("data") or []
    if not data:
        raise ValueError(f"model: {base_url}/models lists no model; pass --model")
    return data[0]["id"]


async def run_benchmark(base_url: str, requests: list[WorkloadRequest], model: str | None = None,
                        api_key: str | None = None, max_concurrency: int | None = None,
                        temperature: float = 0.0, timeout: float = 3600.0) -> dict[str, Any]:
    """Send every request at its arrival_time (seconds after start); returns the summary."""
    base_url = base_url.rstrip("/")
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=max_concurrency or len(requests) + 8,
                          max_keepalive_connections=max_concurrency or len(requests) + 8)
    sem = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout), limits=limits) as client:
        if model is None:
            model = await resolve_model(client, base_url, headers)

        async def one(req: WorkloadRequest) -> RequestResult:
            if sem is None:
                return await send_request(client, base_url, model, req, headers, temperature)
            async with sem:
                return await send_request(client, base_url, model, req, headers, temperature)

        start = time.perf_counter()
        tasks = []
        for req in requests:
            delay = start + req.arrival_time - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(req)))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
    summary = summarize(results, duration)
    summary["model"] = model
    summary["requests"] = [{k: v for k, v in asdict(r).items() if k != "itl"} for r in results]
    return summary


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
    requests = make_workload(args.workload, args.num_requests, args.request_rate,
                             seed=getattr(args, "seed", 0))
    summary = asyncio.run(run_benchmark(
        args.base_url, requests, model=args.model, api_key=args.api_key,
        max_concurrency=max_concurrency, temperature=getattr(args, "temperature", 0.0)))
    rate = args.request_rate if math.isfinite(args.request_rate) else "inf"
    config = {"base_url": args.base_url, "workload": args.workload, "num_requests": len(requests),
              "request_rate": rate, "max_concurrency": max_concurrency, "seed": getattr(args, "seed", 0)}
    print(format_summary(summary))
    errors = [r["error"] for r in summary["requests"] if r["error"]]
    if errors:
        print(f"{len(errors)} requests failed; first error: {errors[0]}", file=sys.stderr)
    if args.output:
        from pagedserve.benchmark.results import write_result
        write_result(args.output, "serve", "pagedserve " + shlex.join(sys.argv[1:]), config, _json_safe(summary),
                     device=f"the server at {args.base_url} (measured from the client)")
        print(f"wrote {args.output}", file=sys.stderr)
    return 0 if summary["failed"] == 0 else 1
