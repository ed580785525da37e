"""How many KV blocks fit: the start-up profile (ModelRunner.determine_num_blocks calls it).

One forward of max_num_batched_tokens tokens over a scratch pool, timed (the measured cost of
recomputing a token, which preemption_mode="auto" weighs against a swap) and, on CUDA, watched
for its peak memory: the KV budget is gpu_memory_utilization of the device minus that peak and
whatever lives outside torch's allocator (CUDA context, cuBLAS, NCCL).
"""
from __future__ import annotations

import logging
import time

import numpy as np
import torch

from pagedserve.attention.backend import Attention, calibrate_kv_scales
from pagedserve.runner.batch import build_model_input
from pagedserve.runner.cache_engine import CacheEngine
from pagedserve.runner.runner_view import RunnerView

logger = logging.getLogger("pagedserve.runner.model_runner")  # the runner's start-up log lines
GiB = 1 << 30


def profile_num_gpu_blocks(runner: RunnerView) -> int:
    """Blocks that fit in gpu_memory_utilization of the device after the model's weights and the
    peak activations of a forward pass of max_num_batched_tokens tokens (max_num_seqs sequences).
    On CPU the same forward runs and is timed, and the pool comes from cpu_kv_cache_gib."""
    cfg = runner.config
    cuda = runner.device.type == "cuda"
    sched = cfg.scheduler_config(runner.max_model_len)
    # The largest step the scheduler can build: no sequence longer than max_model_len (a longer
    # one would index past a learned position table, e.g. OPT's, on the device).
    num_tokens = min(sched.max_num_batched_tokens, sched.max_num_seqs * runner.max_model_len)
    num_seqs = min(sched.max_num_seqs, num_tokens)
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(runner.device)
    inp, scratch = _prompt_batch(runner, num_tokens, num_seqs)
    runner._forward(inp, scratch.kv_caches)  # warm-up: kernel compilation and autotuning happen here
    seconds = device_seconds(runner.device, lambda: runner._forward(inp, scratch.kv_caches))
    runner.profile["recompute_seconds_per_token"] = seconds / num_tokens
    if not cuda:
        return runner._cpu_pool_blocks()
    peak = torch.cuda.max_memory_allocated(runner.device) - scratch.gpu_pool.numel() * scratch.gpu_pool.element_size()
    del scratch, inp
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(runner.device)
    non_torch = total - free - torch.cuda.memory_reserved(runner.device)  # CUDA context, cuBLAS, NCCL
    budget = total * cfg.gpu_memory_utilization - peak - non_torch
    runner.profile.update(peak_bytes=float(peak), non_torch_bytes=float(non_torch), kv_budget_bytes=float(budget))
    logger.info("KV cache budget %.2f GiB (peak %.2f GiB, other %.2f GiB of %.2f GiB)", budget / GiB, peak / GiB,
                non_torch / GiB, total / GiB)
    return int(max(0, budget) // runner.block_bytes)


def _prompt_batch(runner: RunnerView, num_tokens: int, num_seqs: int) -> tuple:
    """(model input, scratch pool) of num_seqs fresh prompts of random ids, num_tokens in all."""
    query_lens = np.full(num_seqs, num_tokens // num_seqs, dtype=np.int64)
    query_lens[: num_tokens % num_seqs] += 1
    tables, nxt = [], 0
    for q in query_lens.tolist():
        nb = -(-q // runner.block_size)
        tables.append(list(range(nxt, nxt + nb)))
        nxt += nb
    scratch = CacheEngine(runner.num_layers, runner.num_kv_heads, runner.head_dim, runner.block_size, nxt, 0,
                          runner.kv_dtype, runner.device)
    ids = np.random.default_rng(0).integers(0, runner.vocab_size, size=num_tokens)
    inp = build_model_input(ids, np.zeros(num_seqs, dtype=np.int64), query_lens, tables,
                            np.ones(num_seqs, dtype=bool), 0, runner.block_size, runner.device)
    return inp, scratch


# calculate_kv_scales' forward: enough tokens for every layer's K/V range to show, few enough for a CPU.
CALIBRATION_TOKENS = 1024


def calibrate_kv_scales_at_startup(runner: RunnerView) -> None:
    """calculate_kv_scales: one forward of random prompts (before the profile, the pools and any CUDA
    graph, so all of them see the final scales) sets every layer's K/V scales (backend.calibrate_kv_scales),
    per KV head with kv_cache_scale_strategy "attn_head": the warm-up and the graphs then compile and
    capture the per-head kernels (their variant follows the scales' shape)."""
    num_tokens = min(CALIBRATION_TOKENS, runner.max_model_len * 4)
    num_seqs = max(1, min(4, num_tokens))
    inp, scratch = _prompt_batch(runner, num_tokens, num_seqs)
    per_head = runner.config.kv_cache_scale_strategy == "attn_head"
    with calibrate_kv_scales(runner.model, per_head=per_head):
        runner._forward(inp, scratch.kv_caches)
    del scratch
    # Per head, each layer's figure is its largest head's scale (the log's range over layers).
    scales = [float(m.k_scale.max()) for m in runner.model.modules() if isinstance(m, Attention)]
    logger.info("KV scales calibrated%s: K scale %.4g..%.4g over %d layers", " per KV head" if per_head else "",
                min(scales), max(scales), len(scales))


def device_seconds(device: torch.device, fn) -> float:
    """Seconds fn() takes on this device (CUDA events on a GPU, the wall clock on CPU)."""
    if device.type != "cuda":
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0
    torch.cuda.synchronize(device)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    torch.cuda.synchronize(device)
    return start.elapsed_time(end) / 1e3
