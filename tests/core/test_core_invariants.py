"""Random interleavings of add / step / fork / abort under memory pressure (so preemption by swap
and by recompute, copy-on-write and prefix hits all happen), checking every docs/design.md invariant
after each operation and the KV each sequence attends to after each step."""
from __future__ import annotations

from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from core_helpers import Driver, check_invariants, make_group, make_scheduler

PREFIXES = [[7] * 12, list(range(12)), [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8]]


class SchedulerMachine(RuleBasedStateMachine):
    @initialize(
        block_size=st.sampled_from([1, 2, 4, 8]),
        num_gpu_blocks=st.integers(6, 40),
        num_cpu_blocks=st.sampled_from([0, 4, 64]),
        mode=st.sampled_from(["recompute", "swap", "auto"]),
        allocator=st.sampled_from(["paged", "paged", "paged", "contiguous-max", "contiguous-pow2",
                                   "contiguous-oracle"]),
        budget=st.sampled_from([4, 16, 64]),
        max_num_seqs=st.sampled_from([2, 8]),
        prefix_caching=st.booleans(),
        chunked=st.booleans(),
        window=st.sampled_from([0, 0, 1, 3, 8]),
        policy=st.sampled_from(["fcfs", "priority"]),
        # The long-prefill options (core/scheduler.py _schedule_prefill, core/admission.py), at
        # sizes this machine's prompts (up to 42 tokens) and budgets reach.
        threshold=st.sampled_from([0, 0, 3, 8]),
        align=st.sampled_from([0, 0, 2, 4, 8]),
        cost_context=st.sampled_from([0, 0, 8, 32]),
        cost_min_tokens=st.sampled_from([0, 20]),
        drain=st.sampled_from([0, 0, 4, 12]),
        drain_min_tokens=st.sampled_from([8, 32]),
    )
    def setup(self, block_size, num_gpu_blocks, num_cpu_blocks, mode, allocator, budget, max_num_seqs,
              prefix_caching, chunked, window, policy, threshold, align, cost_context, cost_min_tokens,
              drain, drain_min_tokens):
        self.max_model_len = 48
        if not chunked:
            budget = max(budget, self.max_model_len)
            # EngineConfig refuses these without chunked prefill (each sizes prefill chunks).
            threshold = align = cost_context = 0
        self.paged = allocator == "paged"
        window = window if self.paged else 0  # (the engine sets one only for the paged allocator)
        sched = make_scheduler(num_gpu_blocks, block_size, num_cpu_blocks, max_num_seqs=max_num_seqs,
                               max_num_batched_tokens=budget, max_model_len=self.max_model_len,
                               preemption_mode=mode, enable_chunked_prefill=chunked,
                               enable_prefix_caching=prefix_caching, kv_allocator=allocator, watermark=0.0,
                               sliding_window=window, scheduling_policy=policy,
                               long_prefill_token_threshold=threshold, long_prefill_chunk_align=align,
                               attention_cost_context=cost_context, attention_cost_min_tokens=cost_min_tokens,
                               long_prefill_drain=drain, long_prefill_drain_min_tokens=drain_min_tokens)
        self.driver = Driver(sched)
        self.next_id = 0

    @property
    def sched(self):
        return self.driver.sched

    @rule(data=st.data(), prefix=st.sampled_from([None, 0, 1, 2]), own=st.integers(1, 30),
          max_tokens=st.integers(1, 20), n=st.sampled_from([1, 1, 2, 3]), priority=st.integers(-2, 2))
    def add(self, data, prefix, own, max_tokens, n, priority):
        tokens = (PREFIXES[prefix] if prefix is not None else []) + \
            data.draw(st.lists(st.integers(0, 49), min_size=own, max_size=own))
        if not self.paged:
            n = 1
        max_tokens = min(max_tokens, max(1, self.max_model_len - len(tokens)))
        group = make_group(str(self.next_id), tokens, max_tokens=max_tokens, n=n)
        if self.sched.scheduler_config.scheduling_policy == "priority":
            group.priority = priority
        self.sched.add_seq_group(group)
        self.next_id += 1

    @rule(k=st.integers(1, 12))
    def step(self, k):
        for _ in range(k):
            if not self.sched.has_unfinished_seqs():
                return
            self.driver.step()
            check_invariants(self.sched)

    @rule(data=st.data())
    def abort(self, data):
        groups = list(self.sched.waiting) + self.sched.running + self.sched.swapped
        if not groups:
            return
        g = data.draw(st.sampled_from(groups))
        self.sched.abort_seq_group(g.request_id)
        assert all(s.status.finished for s in g.seqs)

    @invariant()
    def invariants_hold(self):
        if hasattr(self, "driver"):
            check_invariants(self.sched)

    def teardown(self):
        if not hasattr(self, "driver"):
            return
        self.driver.run()  # everything finishes: nothing leaks (checked at the end of run)
        for name, n in self.driver.counts.items():
            if n:
                event(name)
        check_invariants(self.sched)
        stats = self.sched.get_kv_cache_stats()
        assert stats.num_blocks_used == 0 and stats.num_swapped_blocks == 0


SchedulerMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=30, deadline=None,
                                              suppress_health_check=[HealthCheck.too_slow])
TestSchedulerMachine = SchedulerMachine.TestCase
