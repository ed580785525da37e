"""The periodic stats line (vLLM's; `--disable-log-stats` turns it off): throughputs from the
server's own token counters between two lines, the engine's gauges, and no line while idle after
the one that says so."""
from __future__ import annotations

import asyncio
import logging

import pytest

from pagedserve.entrypoints.openai.stats_log import StatsLine, log_stats_forever
from pagedserve.metrics import EngineSnapshot, ServerMetrics


def test_line_reads_the_counters_and_the_snapshot():
    m = ServerMetrics()
    stats = StatsLine(m, now=100.0)
    m.prompt_tokens.inc(500)
    m.generation_tokens.inc(40)
    m.observe_snapshot(EngineSnapshot(num_running=3, num_waiting=1, kv_cache_usage=0.125, prefix_cache_hit_rate=0.5))
    line, busy = stats.next(now=110.0)
    assert busy and line == ("Avg prompt throughput: 50.0 tokens/s, Avg generation throughput: 4.0 tokens/s, "
                             "Running: 3 reqs, Waiting: 1 reqs, KV cache usage: 12.5%, Prefix cache hit rate: 50.0%")
    m.observe_snapshot(EngineSnapshot())
    line, busy = stats.next(now=120.0)
    assert not busy and line.startswith("Avg prompt throughput: 0.0 tokens/s, Avg generation throughput: 0.0")


def test_logs_while_busy_and_once_on_falling_idle(caplog):
    m = ServerMetrics()
    clock = [0.0]
    work = iter([0, 10, 20, 0, 0, 5])  # generated tokens in each interval

    async def sleep(seconds):
        clock[0] += seconds
        step = next(work, None)
        if step is None:
            raise asyncio.CancelledError
        m.generation_tokens.inc(step)

    with caplog.at_level(logging.INFO, logger="pagedserve.server"):
        with pytest.raises(asyncio.CancelledError):
            asyncio.run(log_stats_forever(m, interval=10.0, sleep=sleep, clock=lambda: clock[0]))
    rates = [r.getMessage().split("Avg generation throughput: ")[1].split(" ")[0] for r in caplog.records]
    # idle at start: nothing; 1.0 and 2.0 tokens/s; the interval it fell idle: one line; then silent; busy again
    assert rates == ["1.0", "2.0", "0.0", "0.5"]
