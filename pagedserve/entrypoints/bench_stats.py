"""What a benchmark run's per-request records say: latency percentiles, throughputs (the whole
run's, the backlog's, a window's), errors by kind. The records are bench_serve.py's
RequestResult, or their dicts (run_benchmark(..., keep_itl=True)'s `requests`); nothing here
talks to a server.
"""
from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import numpy as np

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
    sent_at: float | None = None  # seconds after the run's start (its client process's) it was sent
    retries: int = 0  # times it was sent again after failing before any response (send_request)

    @property
    def tpot(self) -> float | None:
        if self.ttft is None or self.output_len < 2:
            return None
        return (self.latency - self.ttft) / (self.output_len - 1)


def describe_error(e: BaseException) -> str:
    """`Class: message`, with the OS error beneath it when there is one: httpx's ReadError on a
    reset connection has an empty message (anyio's BrokenResourceError), its cause says which."""
    text = f"{type(e).__name__}: {e}"
    inner, seen = e, 0
    while (inner := inner.__cause__ or inner.__context__) is not None and seen < 8:
        seen += 1
        if isinstance(inner, OSError):
            return f"{text} ({type(inner).__name__}: {inner})"
    return text


def error_counts(errors: list[str]) -> dict[str, int]:
    """How many requests failed with each kind of error (the text before the first ':'),
    most first."""
    return dict(Counter(err.split(":", 1)[0] for err in errors).most_common())


def _stats(values: list[float], scale: float = 1000.0) -> dict[str, float]:
    """mean / median / pNN of a latency list, in milliseconds."""
    if not values:
        return {"mean": math.nan, **{f"p{p}": math.nan for p in PERCENTILES}}
    a = np.asarray(values) * scale
    return {"mean": float(a.mean()), **{f"p{p}": float(np.percentile(a, p)) for p in PERCENTILES}}


def backlog_throughput(results: list[RequestResult]) -> dict[str, float] | None:
    """Output tokens per second from the run's start until the last request got its first token.

    Until then some request was still waiting, so the servers had a backlog: with every request
    sent at t=0 this is the saturated rate, without the drain at the end (the last batches
    shrinking), which weighs more the shorter the run is. Chunks are counted as output_len /
    chunks tokens each. None without first tokens or send times."""
    ok = [r for r in results if r.error is None and r.ttft is not None and r.sent_at is not None]
    if not ok:
        return None
    window = max(r.sent_at + r.ttft for r in ok)
    if window <= 0:
        return None
    records = [{"error": None, "ttft": r.ttft, "sent_at": r.sent_at, "itl": r.itl, "output_len": r.output_len}
               for r in ok]
    tokens = tokens_between(records, 0.0, window)
    return {"window_s": window, "output_throughput": tokens / window}


def tokens_between(records: list[dict], t0: float, t1: float) -> float:
    """Output tokens that reached the client between t0 and t1 (seconds from the run's start),
    from records with error, sent_at, ttft, itl and output_len (run_benchmark(..., keep_itl=True));
    a chunk counts output_len / chunks tokens (a relay may pass several tokens in one)."""
    tokens = 0.0
    for r in records:
        if r["error"] is not None or r["ttft"] is None or r["sent_at"] is None:
            continue
        per_chunk = r["output_len"] / (1 + len(r["itl"]))
        t = r["sent_at"] + r["ttft"]
        n = 1 if t0 <= t <= t1 else 0
        for gap in r["itl"]:
            t += gap
            if t > t1:
                break
            n += t >= t0
        tokens += n * per_chunk
    return tokens


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
        "backlog": backlog_throughput(ok),
        "errors": error_counts([r.error for r in results if r.error is not None]),
        "retried": sum(r.retries for r in results),
    }
