"""The benchmark workloads of docs/benchmarks.md, drawn by its rule so two engines run the same work.

With random.Random(0): all prompt lengths first, then all output lengths, then each
request's token ids uniform in [0, 10000), request by request. Poisson arrival
times come from a separate random.Random(1).
"""
from __future__ import annotations

import math
import random
from dataclasses import dataclass, replace

VOCAB_DRAW = 10000


@dataclass
class WorkloadRequest:
    prompt_token_ids: list[int]
    output_len: int
    arrival_time: float = 0.0
    # Extra body fields a serving client sends with this request (e.g. structured_outputs).
    extra_body: dict | None = None


@dataclass(frozen=True)
class WorkloadSpec:
    name: str
    num_requests: int
    prompt: tuple            # ("uniform", lo, hi) | ("fixed", n) | ("lognormal", mean, sigma)
    output: tuple
    max_total_len: int = 4096
    shared_prefix_len: int = 0


WORKLOADS: dict[str, WorkloadSpec] = {
    "nanovllm": WorkloadSpec("nanovllm", 256, ("uniform", 100, 1024), ("uniform", 100, 1024)),
    "fixed256": WorkloadSpec("fixed256", 1000, ("fixed", 256), ("fixed", 256)),
    # Paper §6: ShareGPT 161.31 in / 337.99 out, Alpaca 19.31 / 58.45; OPT's context is 2048.
    "sharegpt-like": WorkloadSpec("sharegpt-like", 1000, ("lognormal", 161.31, 1.0),
                                  ("lognormal", 337.99, 1.0), max_total_len=2048),
    "alpaca-like": WorkloadSpec("alpaca-like", 1000, ("lognormal", 19.31, 0.8),
                                ("lognormal", 58.45, 0.8), max_total_len=2048),
    "shared-prefix": WorkloadSpec("shared-prefix", 100, ("uniform", 20, 200), ("fixed", 128),
                                  max_total_len=8192, shared_prefix_len=5000),
}


def _draw_len(rng: random.Random, dist: tuple, cap: int) -> int:
    kind = dist[0]
    if kind == "uniform":
        n = rng.randint(dist[1], dist[2])
    elif kind == "lognormal":
        mean, sigma = dist[1], dist[2]
        mu = math.log(mean) - sigma * sigma / 2  # so that E[X] = mean
        n = int(round(rng.lognormvariate(mu, sigma)))
    else:
        raise ValueError(f"unknown length distribution {kind!r}")
    return max(1, min(n, cap))


def make_workload(name: str, num_requests: int | None = None, request_rate: float | None = None,
                  seed: int = 0, vocab_size: int | None = None,
                  max_total_len: int | None = None,
                  shared_prefix_len: int | None = None) -> list[WorkloadRequest]:
    """Requests of a named workload; request_rate (req/s) gives Poisson arrival times.

    For a model smaller than the workload assumes, vocab_size (ids drawn from
    [0, min(10000, vocab_size))) and max_total_len (prompt + output never above it; the
    workload's own cap when larger) fit it. shared_prefix_len replaces the workload's shared
    prefix length (a shorter system prompt for a smaller run). Left at None, the draw is
    docs/benchmarks.md's exactly.
    """
    if name not in WORKLOADS:
        raise ValueError(f"workload must be one of {sorted(WORKLOADS)}, got {name!r}")
    spec = WORKLOADS[name]
    if shared_prefix_len is not None:
        if shared_prefix_len < 0:
            raise ValueError(f"shared_prefix_len must be >= 0, got {shared_prefix_len}")
        spec = replace(spec, shared_prefix_len=shared_prefix_len)
    n = spec.num_requests if num_requests is None else num_requests
    if n < 1:
        raise ValueError(f"num_requests must be >= 1, got {n}")
    if vocab_size is not None and vocab_size < 1:
        raise ValueError(f"vocab_size must be >= 1, got {vocab_size}")
    draw = VOCAB_DRAW if vocab_size is None else min(VOCAB_DRAW, vocab_size)
    total = spec.max_total_len if max_total_len is None else min(spec.max_total_len, max_total_len)
    fixed_total = (spec.prompt[1] if spec.prompt[0] == "fixed" else 0) + \
        (spec.output[1] if spec.output[0] == "fixed" else 0)
    if total < spec.shared_prefix_len + 2 or total < fixed_total + spec.shared_prefix_len:
        raise ValueError(f"max_total_len: workload {name!r} needs at least "
                         f"{max(spec.shared_prefix_len + 2, fixed_total + spec.shared_prefix_len)} "
                         f"tokens per request, got {total}")
    rng = random.Random(seed)
    half = (total - spec.shared_prefix_len) // 2
    if spec.prompt[0] == "fixed":
        prompt_lens = [spec.prompt[1]] * n
    else:
        prompt_lens = [_draw_len(rng, spec.prompt, half) for _ in range(n)]
    if spec.output[0] == "fixed":
        output_lens = [spec.output[1]] * n
    else:
        output_lens = [_draw_len(rng, spec.output, total - spec.shared_prefix_len - p)
                       for p in prompt_lens]
    prefix = [rng.randrange(draw) for _ in range(spec.shared_prefix_len)]
    reqs = []
    for p, o in zip(prompt_lens, output_lens):
        ids = prefix + [rng.randrange(draw) for _ in range(p)]
        reqs.append(WorkloadRequest(ids, o))
    if request_rate is not None and math.isfinite(request_rate):
        if request_rate <= 0:
            raise ValueError(f"request_rate must be > 0, got {request_rate}")
        arng, t = random.Random(seed + 1), 0.0
        for r in reqs:
            t += arng.expovariate(request_rate)
            r.arrival_time = t
    return reqs
