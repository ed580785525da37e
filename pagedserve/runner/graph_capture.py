"""The runner's CUDA graphs, captured at start-up and released at shutdown.

capture_decode_graphs, capture_full_graphs and capture_piecewise_graphs are three of
ModelRunner.init_kv_cache's phases (ModelRunner methods of those names call them, which a
tensor-parallel executor runs by name on every rank); each fills one of the runner's graph holders
(graphs, full_graphs, piecewise). release_cuda_graphs empties all three. Which graph a step
replays is ModelRunner.execute_model's choice.
"""
from __future__ import annotations

import logging
import time

import torch

from pagedserve.attention.backend import Attention
from pagedserve.runner.cuda_graph import DecodeCUDAGraphs, batch_buckets, graph_capturable
from pagedserve.runner.full_graphs import FullCUDAGraphs
from pagedserve.runner.piecewise_graphs import PiecewiseCUDAGraphs, supports_piecewise
from pagedserve.runner.runner_view import RunnerView

logger = logging.getLogger("pagedserve.runner.model_runner")  # the runner's start-up log lines


def capture_decode_graphs(runner: RunnerView) -> None:
    """One CUDA graph per decode batch-size bucket, up to max_num_seqs (CUDA, unless enforce_eager)."""
    runner._require("cache")
    if runner.device.type != "cuda" or runner.config.enforce_eager:
        return
    if not graph_capturable(runner.model):
        logger.warning("%s has a layer that cannot be captured (PAGEDSERVE_FUSED_MOE=0?): no CUDA graphs",
                       type(runner.model).__name__)
        return
    max_batch = runner.config.scheduler_config(runner.max_model_len).max_num_seqs
    buckets = batch_buckets(max_batch, runner.config.cuda_graph_sizes)
    if not buckets:
        return  # every size given exceeds max_num_seqs: decode steps run eagerly
    runner.graphs = DecodeCUDAGraphs(runner.model, runner.kv_caches, buckets, max_model_len=runner.max_model_len,
                                     block_size=runner.block_size, device=runner.device,
                                     num_kv_heads=runner.num_kv_heads, nano_batch_rows=runner.config.nano_batch_rows,
                                     sm_carveout=runner.config.nano_batch_sm_carveout)
    runner.graphs.capture()


def capture_full_graphs(runner: RunnerView, graph_factory=None) -> None:
    """Full graphs (runner/full_graphs.py) for steps with prefill tokens, per token-count bucket up
    to min(max_num_batched_tokens, 8192). Only with cudagraph_mode="full", on CUDA (graph_factory:
    a CPU stand-in for tests), unless enforce_eager, for graph-capturable models on one rank."""
    runner._require("cache")
    cfg = runner.config
    if cfg.enforce_eager or cfg.cudagraph_mode != "full":
        return
    if graph_factory is None and runner.device.type != "cuda":
        return
    if runner.tp_size > 1 or not graph_capturable(runner.model):
        logger.info("no full CUDA graphs for %s with tensor_parallel_size=%d: steps with prefill tokens "
                    "run eagerly", type(runner.model).__name__, runner.tp_size)
        return
    sched = cfg.scheduler_config(runner.max_model_len)
    attn = next(m for m in runner.model.modules() if isinstance(m, Attention))
    t0 = time.perf_counter()
    runner.full_graphs = FullCUDAGraphs(runner.model, runner.kv_caches, sched.max_num_batched_tokens,
                                        sched.max_num_seqs, runner.max_model_len, runner.block_size, attn.num_heads,
                                        attn.num_kv_heads, runner.device,
                                        pool=runner.graphs.pool if runner.graphs is not None else None,
                                        graph_factory=graph_factory)
    runner.full_graphs.capture()
    logger.info("captured %d full CUDA graphs (token buckets up to %d) in %.1f s", runner.full_graphs.num_graphs,
                runner.full_graphs.buckets[-1], time.perf_counter() - t0)


def capture_piecewise_graphs(runner: RunnerView) -> None:
    """Piecewise graphs (runner/piecewise_graphs.py) for steps with prefill tokens, per token-count
    bucket up to min(max_num_batched_tokens, 1024; PAGEDSERVE_PIECEWISE_MAX_TOKENS). Only with cudagraph_mode="piecewise", on CUDA,
    unless enforce_eager, for Llama-family models and a single rank (tensor parallelism keeps
    those steps eager: its executor runs the start-up phases one by one and has no such phase)."""
    runner._require("cache")
    cfg = runner.config
    if runner.device.type != "cuda" or cfg.enforce_eager or cfg.cudagraph_mode != "piecewise":
        return
    if runner.tp_size > 1 or not supports_piecewise(runner.model) or not graph_capturable(runner.model):
        logger.info("no piecewise CUDA graphs for %s with tensor_parallel_size=%d: steps with prefill "
                    "tokens run eagerly", type(runner.model).__name__, runner.tp_size)
        return
    max_tokens = cfg.scheduler_config(runner.max_model_len).max_num_batched_tokens
    t0 = time.perf_counter()
    runner.piecewise = PiecewiseCUDAGraphs(runner.model, runner.kv_caches, max_tokens, runner.device,
                                           pool=runner.graphs.pool if runner.graphs is not None else None)
    runner.piecewise.capture()
    logger.info("captured %d piecewise CUDA graphs (%d token buckets up to %d) in %.1f s",
                runner.piecewise.num_graphs, len(runner.piecewise.buckets), runner.piecewise.buckets[-1],
                time.perf_counter() - t0)


def release_cuda_graphs(runner: RunnerView, synchronize: bool = True) -> int:
    """Destroy every captured CUDA graph now; returns how many. Tensor parallelism needs this before
    its NCCL groups go: a graph that captured an all-reduce holds a reference on the communicator,
    and NCCL's destroy (and abort) spins until every such graph is gone: with the graphs still
    alive, the teardown never returned (2xH200). Eager steps still work afterwards.
    synchronize=False after a failure: a graph stuck in a collective must not block here."""
    graphs = []
    if runner.graphs is not None:
        graphs += list(runner.graphs.graphs.values())
    if runner.piecewise is not None:
        graphs += [g for pieces in runner.piecewise.pieces.values() for g in pieces]
    full = getattr(runner, "full_graphs", None)
    if full is not None:
        graphs += list(full.graphs.values())
    runner.graphs = runner.piecewise = runner.full_graphs = None
    for g in graphs:
        reset = getattr(g, "reset", None)
        if reset is not None:
            reset()
    if graphs and synchronize and runner.device.type == "cuda":
        torch.cuda.synchronize(runner.device)
    return len(graphs)
