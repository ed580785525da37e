"""The server's periodic stats line (vLLM's, on by default; `--disable-log-stats` turns it off):
every STATS_INTERVAL_S while the engine is busy, the prompt and generation throughput since the
last line, the requests running and waiting, the KV cache's usage and the prefix cache's hit rate,
read from the server's own metrics (metrics.ServerMetrics), so it costs the engine nothing. An
idle engine gets one line when it falls idle, then none until it works again."""
from __future__ import annotations

import asyncio
import logging
import time
from typing import Awaitable, Callable

from pagedserve.metrics import PREFIX, ServerMetrics

logger = logging.getLogger("pagedserve.server")
STATS_INTERVAL_S = 10.0


class StatsLine:
    """Throughputs between two reads of the metrics' token counters."""

    def __init__(self, metrics: ServerMetrics, now: float) -> None:
        self.metrics = metrics
        self.last = (now, *self._tokens())

    def _tokens(self) -> tuple[float, float]:
        get = self.metrics.registry.get_sample_value
        return (get(PREFIX + "prompt_tokens_total") or 0.0, get(PREFIX + "generation_tokens_total") or 0.0)

    def next(self, now: float) -> tuple[str, bool]:
        """(the line, whether the engine worked since the last one or has requests now)."""
        prompt, generated = self._tokens()
        t0, p0, g0 = self.last
        self.last = (now, prompt, generated)
        dt = max(now - t0, 1e-9)
        s = self.metrics.snapshot
        busy = prompt > p0 or generated > g0 or s.num_running > 0 or s.num_waiting > 0
        line = (f"Avg prompt throughput: {(prompt - p0) / dt:.1f} tokens/s, Avg generation throughput: "
                f"{(generated - g0) / dt:.1f} tokens/s, Running: {s.num_running} reqs, Waiting: {s.num_waiting} "
                f"reqs, KV cache usage: {100 * s.kv_cache_usage:.1f}%, Prefix cache hit rate: "
                f"{100 * s.prefix_cache_hit_rate:.1f}%")
        return line, busy


async def log_stats_forever(metrics: ServerMetrics, interval: float = STATS_INTERVAL_S,
                            sleep: Callable[[float], Awaitable] = asyncio.sleep,
                            clock: Callable[[], float] = time.monotonic) -> None:
    """Log a StatsLine every `interval` seconds while busy, and once as the engine falls idle."""
    stats = StatsLine(metrics, clock())
    idle_logged = True  # nothing to say before the first request
    while True:
        await sleep(interval)
        line, busy = stats.next(clock())
        if busy or not idle_logged:
            logger.info("%s", line)
        idle_logged = not busy
