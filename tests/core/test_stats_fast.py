"""get_kv_cache_stats(token_counts=False): the O(1) read the server snapshots after every step
equals the full stats in every field it fills, under preemption (recompute and swap) and prefix hits."""
import dataclasses

import pytest
from core_helpers import Driver, make_group, make_scheduler


@pytest.mark.parametrize("mode,cpu_blocks", [("recompute", 0), ("swap", 16)])
def test_fast_stats_equal_full_stats_step_by_step(mode, cpu_blocks):
    s = make_scheduler(8, block_size=4, num_cpu_blocks=cpu_blocks, preemption_mode=mode,
                       max_model_len=32)
    shared = list(range(100, 108))  # two full blocks every request shares: prefix-cache hits
    for i in range(5):
        s.add_seq_group(make_group(str(i), shared + [200 + i], max_tokens=8, n=1, oracle=8))
    d = Driver(s)
    steps = 0
    live_seen = False
    while s.has_unfinished_seqs():
        d.step()
        steps += 1
        full = s.get_kv_cache_stats()
        fast = s.get_kv_cache_stats(token_counts=False)
        assert fast.num_live_tokens is None
        assert dataclasses.replace(fast, num_live_tokens=full.num_live_tokens) == full
        assert (fast.usage, fast.prefix_cache_hit_rate) == (full.usage, full.prefix_cache_hit_rate)
        live_seen |= full.num_live_tokens > 0
        assert steps < 500
    final = s.get_kv_cache_stats()
    assert final.num_preemptions > 0 and final.prefix_cache_hits > 0 and live_seen
    with pytest.raises(ValueError, match="token_counts"):
        _ = s.get_kv_cache_stats(token_counts=False).utilization
