"""Replay timed arrivals through an LLMEngine in wall-clock time: the paper's serving experiments.

Requests are added when their Poisson arrival time has passed; the engine steps
whenever it has work. Per request we keep TTFT, end-to-end latency and output length;
per step, how many requests ran together.
"""
from __future__ import annotations

import statistics
import time
from collections import deque
from dataclasses import dataclass, field

from pagedserve.workloads import WorkloadRequest


@dataclass
class ReplayResult:
    duration_s: float
    ttft_s: list[float] = field(default_factory=list)
    e2e_s: list[float] = field(default_factory=list)
    output_lens: list[int] = field(default_factory=list)
    batch_sizes: list[int] = field(default_factory=list)
    ttft_by_arrival: list[float] = field(default_factory=list)
    num_preemptions: int = 0
    peak_blocks_used: int = 0

    @property
    def normalized_latency(self) -> float:
        """Mean over requests of end-to-end latency / output tokens (paper §6, s/token)."""
        return statistics.mean(e / max(n, 1) for e, n in zip(self.e2e_s, self.output_lens))

    def summary(self) -> dict:
        q = lambda xs, p: sorted(xs)[min(len(xs) - 1, int(p * len(xs)))] if xs else None  # noqa: E731
        return {"duration_s": round(self.duration_s, 3), "num_requests": len(self.e2e_s),
                "normalized_latency_s_per_token": round(self.normalized_latency, 5),
                "mean_ttft_s": round(statistics.mean(self.ttft_s), 4), "p90_ttft_s": round(q(self.ttft_s, 0.9), 4),
                "mean_e2e_s": round(statistics.mean(self.e2e_s), 3),
                "avg_batched_requests": round(statistics.mean(self.batch_sizes), 2) if self.batch_sizes else 0,
                "output_tokens_per_s": round(sum(self.output_lens) / self.duration_s, 1),
                "num_preemptions": self.num_preemptions, "peak_blocks_used": self.peak_blocks_used}


def replay(engine, reqs: list[WorkloadRequest], params_for, realtime: bool = True, on_step=None) -> ReplayResult:
    """Drive `engine` with `reqs`; params_for(req) gives its SamplingParams.

    realtime=False adds everything at once (arrival times ignored), for offline batches.
    on_step(engine), if given, runs after every step (e.g. to sample the memory breakdown).
    """
    pending = deque(sorted(enumerate(reqs), key=lambda x: x[1].arrival_time))
    arrival, first, done = {}, {}, {}
    result = ReplayResult(0.0)
    t0 = time.perf_counter()
    while pending or engine.has_unfinished_requests():
        now = time.perf_counter() - t0
        while pending and (not realtime or pending[0][1].arrival_time <= now):
            i, r = pending.popleft()
            rid = str(i)
            engine.add_request(rid, {"prompt_token_ids": r.prompt_token_ids}, params_for(r))
            arrival[rid] = (r.arrival_time if realtime else 0.0)
        if not engine.has_unfinished_requests():
            time.sleep(max(0.0, pending[0][1].arrival_time - now))
            continue
        outs = engine.step()
        result.batch_sizes.append(engine.scheduler.num_running)
        if on_step is not None:
            on_step(engine)
        now = time.perf_counter() - t0
        for o in outs:
            if o.request_id not in first and any(c.token_ids for c in o.outputs):
                first[o.request_id] = now
            if o.finished:
                done[o.request_id] = (now, max(len(c.token_ids) for c in o.outputs))
    result.duration_s = time.perf_counter() - t0
    for rid in sorted(done, key=lambda r: (arrival[r], int(r))):
        result.ttft_by_arrival.append(first.get(rid, done[rid][0]) - arrival[rid])
    for rid, (t_end, n) in done.items():
        result.ttft_s.append(first.get(rid, t_end) - arrival[rid])
        result.e2e_s.append(t_end - arrival[rid])
        result.output_lens.append(n)
    stats = engine.get_kv_cache_stats()
    result.num_preemptions, result.peak_blocks_used = stats.num_preemptions, stats.peak_blocks_used
    return result
