"""`pagedserve sim`: replay a workload through the real Scheduler and KV manager, without weights.

Time advances by a linear step-time model; every scheduled sequence that reaches its end
samples a dummy token, and a request finishes at its workload output length. The default
setup is the paper's §6 one: OPT-13B on one A100-40GB, whose Table 1 leaves 12 GB for the
KV cache = 15.7K token slots (800 KB per token), max_model_len 2048 for OPT. The KV budget is
given in tokens so that block sizes compare at equal memory. Deterministic for a seed.
"""
from __future__ import annotations

import json
import os
import random
import shlex
import sys
from dataclasses import asdict, dataclass
from types import SimpleNamespace
from typing import Callable

from pagedserve.model_cost import ModelCost, experts_touched
from pagedserve.core.config import CacheConfig, SchedulerConfig
from pagedserve.core.scheduler import Scheduler
from pagedserve.sampling_params import SamplingParams
from pagedserve.sequence import Sequence, SequenceGroup, SequenceStatus
from pagedserve.workloads import WORKLOADS, make_workload

KV_BUDGET_TOKENS = 15_700          # paper Table 1: OPT-13B on A100-40GB, 12 GB of KV cache
KV_BYTES_PER_TOKEN = 819_200       # OPT-13B: 2 (K, V) * 40 layers * 5120 hidden * 2 bytes
SWAP_SPACE_BYTES = 4 * 2**30       # vLLM's default swap_space of 4 GiB
H200_BANDWIDTH = 4.8e12            # bytes/s, HBM3e peak
H200_BF16_FLOPS = 989e12           # dense bf16 peak
# The "device" of a result made here.
SIM_DEVICE = "sim (pagedserve.sim: real scheduler and KV managers, OPT-13B/A100 step-time model)"


@dataclass
class StepTimeModel:
    """step seconds = fixed + per_token * batched tokens + per_context_token * attended tokens.

    Defaults for OPT-13B (fp16) on an A100-40GB: fixed = reading 26 GB of weights at 1.55 TB/s;
    per_token = 2 * 13e9 FLOPs at half of 312 TFLOP/s; per_context_token = reading 800 KB of KV.
    """
    fixed: float = 26e9 / 1.555e12
    per_token: float = 2 * 13e9 / (0.5 * 312e12)
    per_context_token: float = KV_BYTES_PER_TOKEN / 1.555e12
    pcie_bytes_per_s: float = 25e9
    # Mixture of experts: reading one expert of every sparse layer, paid once per expert the
    # step's tokens touch (expected under uniform routing); per_token then counts active params.
    per_expert: float = 0.0
    num_experts: int = 0
    top_k: int = 0
    kv_bytes_per_token: int = KV_BYTES_PER_TOKEN  # what a swapped token moves

    def step_time(self, num_tokens: int, num_context_tokens: int) -> float:
        t = self.fixed + self.per_token * num_tokens + self.per_context_token * num_context_tokens
        if self.num_experts:
            t += self.per_expert * experts_touched(num_tokens, self.num_experts, self.top_k)
        return t

    @classmethod
    def from_model_cost(cls, cost: ModelCost, bandwidth: float, flops_rate: float,
                        matmul_efficiency: float = 0.5, pcie_bytes_per_s: float = 25e9) -> "StepTimeModel":
        """The same linear model for another model and device (model_cost.ModelCost): the
        dense weights read once per step, the active parameters' FLOPs per token at
        matmul_efficiency of the peak, the KV read per context token, and the experts touched."""
        return cls(fixed=cost.weight_bytes / bandwidth,
                   per_token=2 * cost.active_params / (matmul_efficiency * flops_rate),
                   per_context_token=cost.kv_bytes_per_token / bandwidth, pcie_bytes_per_s=pcie_bytes_per_s,
                   per_expert=cost.expert_bytes / bandwidth, num_experts=cost.num_experts, top_k=cost.top_k,
                   kv_bytes_per_token=cost.kv_bytes_per_token)

    @classmethod
    def for_model_dir(cls, model_dir: str, bandwidth: float = H200_BANDWIDTH,
                      flops_rate: float = H200_BF16_FLOPS) -> "StepTimeModel":
        """From a model directory's config.json (read as plain JSON: the simulator imports no torch),
        on an H200 by default (its peak HBM bandwidth and dense bf16 rate)."""
        path = os.path.join(model_dir, "config.json")
        try:
            with open(path) as f:
                cfg = SimpleNamespace(**json.load(f))
            return cls.from_model_cost(ModelCost.from_hf_config(cfg), bandwidth, flops_rate)
        except (OSError, ValueError, TypeError, AttributeError) as e:
            raise ValueError(f"model: cannot build a step-time model from {path} ({type(e).__name__}: {e})") from None


def simulate(workload: str = "sharegpt-like", allocator: str = "paged", block_size: int = 16,
             num_blocks: int | None = None, num_requests: int | None = None,
             request_rate: float | None = None, max_num_seqs: int = 256, max_model_len: int | None = None,
             seed: int = 0, max_num_batched_tokens: int = 8192, preemption_mode: str = "auto",
             enable_prefix_caching: bool = True, time_model: StepTimeModel | None = None,
             on_step: Callable[[int, Scheduler], None] | None = None, max_steps: int | None = None) -> dict:
    """Run the workload to completion (or for max_steps steps) and return the summary dict (see
    run_sim_cli).

    on_step(step, scheduler), if given, sees the scheduler after every step (for snapshots);
    it must not change it.
    """
    tm = time_model or StepTimeModel()
    spec = WORKLOADS.get(workload)
    if spec is None:
        raise ValueError(f"workload must be one of {sorted(WORKLOADS)}, got {workload!r}")
    max_model_len = max_model_len or spec.max_total_len
    CacheConfig(block_size=block_size, kv_allocator=allocator)  # its checks, before any division by it
    if num_blocks is None:
        num_blocks = KV_BUDGET_TOKENS // block_size
    if num_blocks < 1:
        raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
    num_cpu_blocks = SWAP_SPACE_BYTES // (tm.kv_bytes_per_token * block_size)
    paged = allocator == "paged"
    cache_config = CacheConfig(block_size=block_size, num_gpu_blocks=num_blocks,
                               num_cpu_blocks=num_cpu_blocks if paged else 0,
                               enable_prefix_caching=enable_prefix_caching and paged, kv_allocator=allocator)
    sched_config = SchedulerConfig(
        max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens, max_model_len=max_model_len,
        preemption_mode=preemption_mode,
        swap_seconds_per_block=2 * block_size * tm.kv_bytes_per_token / tm.pcie_bytes_per_s,
        recompute_seconds_per_token=tm.per_token)
    scheduler = Scheduler(sched_config, cache_config)

    reqs = make_workload(workload, num_requests, request_rate, seed=seed)
    token_rng = random.Random(seed + 2)
    pending = sorted(((r.arrival_time, i, r) for i, r in enumerate(reqs)), key=lambda x: (x[0], x[1]))
    next_arrival = 0
    now, steps = 0.0, 0
    arrival, finish, out_len = {}, {}, {}
    sums = {"running": 0.0, "util": 0.0, "util_n": 0, "bd_n": 0}
    bd_sum = {"token_states": 0.0, "reserved": 0.0, "internal_fragmentation": 0.0, "external_fragmentation": 0.0}
    ignored: list[str] = []

    while (next_arrival < len(pending) or scheduler.has_unfinished_seqs()) and steps != max_steps:
        while next_arrival < len(pending) and pending[next_arrival][0] <= now:
            t, i, r = pending[next_arrival]
            next_arrival += 1
            rid = str(i)
            group = SequenceGroup(rid, [Sequence(list(r.prompt_token_ids))],
                                  SamplingParams(max_tokens=r.output_len, ignore_eos=True),
                                  arrival_time=t, oracle_output_len=r.output_len)
            arrival[rid], out_len[rid] = t, r.output_len
            scheduler.add_seq_group(group)
        if not scheduler.has_unfinished_seqs():
            now = pending[next_arrival][0]
            continue
        out = scheduler.schedule()
        ignored.extend(g.request_id for g in out.ignored)
        if out.is_empty:
            if out.ignored:
                continue
            if next_arrival < len(pending):
                now = max(now, pending[next_arrival][0])
                continue
            raise RuntimeError("simulation stalled: nothing schedulable and nothing arriving")
        context = sum(s.context_len for s in out.scheduled)
        dt = tm.step_time(out.num_batched_tokens, context)
        dt += (len(out.blocks_to_swap_in) + len(out.blocks_to_swap_out)) * block_size * tm.kv_bytes_per_token \
            / tm.pcie_bytes_per_s
        sample = [s for s in out.scheduled if s.do_sample]
        scheduler.update_after_step(out)
        now += dt
        steps += 1

        sums["running"] += scheduler.num_running
        bd = scheduler.get_memory_breakdown()
        if bd.total:
            for k, v in bd.fractions().items():
                bd_sum[k] += v
            sums["bd_n"] += 1
        stats = scheduler.get_kv_cache_stats()
        if stats.num_allocated_slots:
            sums["util"] += stats.utilization
            sums["util_n"] += 1

        for s in sample:
            seq, group = s.seq, s.group
            seq.append_token(token_rng.randrange(10000))
            if len(seq.output_token_ids) >= out_len[group.request_id] or seq.num_tokens >= max_model_len:
                seq.status = SequenceStatus.FINISHED_LENGTH
                scheduler.free_seq(seq)
        for g in scheduler.free_finished_seq_groups():
            finish[g.request_id] = now
        if on_step is not None:
            on_step(steps, scheduler)

    stats = scheduler.get_kv_cache_stats()
    done = [rid for rid in finish]
    total_out = sum(out_len[r] for r in done)
    norm_lat = [(finish[r] - arrival[r]) / out_len[r] for r in done]
    n_bd = max(1, sums["bd_n"])
    return {
        "workload": workload,
        "allocator": allocator,
        "block_size": block_size,
        "num_blocks": num_blocks,
        "kv_budget_tokens": num_blocks * block_size,
        "max_model_len": max_model_len,
        "num_requests": len(reqs),
        "num_finished": len(done),
        "num_ignored": len(ignored),
        "request_rate": request_rate,
        "seed": seed,
        "steps": steps,
        "sim_time_s": now,
        "avg_running": sums["running"] / max(1, steps),
        "preemptions": stats.num_preemptions,
        "peak_blocks_used": stats.peak_blocks_used,
        "kv_utilization": sums["util"] / max(1, sums["util_n"]),
        "breakdown": {k: v / n_bd for k, v in bd_sum.items()},
        "normalized_latency_s_per_token": sum(norm_lat) / len(norm_lat) if norm_lat else None,
        "throughput_output_tokens_per_s": total_out / now if now else 0.0,
        "throughput_requests_per_s": len(done) / now if now else 0.0,
        "prefix_cache_hit_rate": stats.prefix_cache_hit_rate,
        "step_time_model": asdict(tm),
    }


def run_sim_cli(args) -> int:
    model = getattr(args, "model", None)
    tm = StepTimeModel.for_model_dir(model) if model else None
    result = simulate(workload=args.workload, allocator=args.allocator, block_size=args.block_size,
                      num_blocks=args.num_blocks, num_requests=args.num_requests,
                      request_rate=args.request_rate, max_num_seqs=args.max_num_seqs,
                      max_model_len=args.max_model_len, seed=args.seed, time_model=tm)
    bd = result["breakdown"]
    print(f"{result['workload']} / {result['allocator']} / block_size {result['block_size']}: "
          f"{result['num_finished']} of {result['num_requests']} requests in {result['steps']} steps "
          f"({result['sim_time_s']:.1f} s simulated), avg running {result['avg_running']:.1f}, "
          f"preemptions {result['preemptions']}")
    print(f"KV memory: token states {bd['token_states']:.1%}, reserved {bd['reserved']:.1%}, "
          f"internal fragmentation {bd['internal_fragmentation']:.1%}, "
          f"external fragmentation {bd['external_fragmentation']:.1%}; utilization {result['kv_utilization']:.1%}")
    print(f"throughput {result['throughput_output_tokens_per_s']:.0f} out tok/s, "
          f"normalized latency {result['normalized_latency_s_per_token'] or 0:.4f} s/token")
    if args.output:
        from pagedserve.benchmark.results import write_result
        config = {k: getattr(args, k, None) for k in ("workload", "allocator", "block_size", "num_blocks",
                                                      "num_requests", "request_rate", "max_num_seqs",
                                                      "max_model_len", "seed", "model")}
        write_result(args.output, "sim", "pagedserve " + shlex.join(sys.argv[1:]), config, result,
                     device=SIM_DEVICE)
    return 0
