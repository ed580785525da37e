"""Full CUDA graphs for steps of any mix (prefill chunks and decodes), one per token-count bucket.

Why: a step with prefill tokens ran as piecewise graphs with attention launched eagerly per layer
(piecewise_graphs.py), ~12 ms at the median on the H200 against ~5.3 ms for a decode-only step
(issue 13's notes), and long prompts make most steps of that kind. Attention was the only op whose
launch depended on the step's lengths. The unified kernel (attention/triton_unified.py) takes
every sequence of a step in one launch whose grid and buffers are sized by the token count and
max_num_seqs alone, and derives its work list from the lengths on the device; so the whole
forward, attention included, is one graph per bucket.

How: static buffers for everything the forward reads (ids, positions, slot mapping, and the
attention metadata of max_num_seqs sequences: query_start_loc, seq_lens, block tables up to
max_model_len). A step of n tokens in s sequences copies its inputs into the first n rows and s
sequences; the remaining sequences get no tokens (query_start_loc stays at n) and the remaining
rows slot -1, so padding neither writes K/V nor attends. The metadata carries
unified_capacity (the bucket's), which sends attention to the unified kernel; the graph of the
smallest bucket >= n replays (not for a step with a long chunk for attention/gathered_prefill.py:
takes). Buckets: piecewise_graphs.token_buckets' (every 128 from 640 to 1024,
then every 256 up to 2048, every 512 up to 4096 and every 1024 up to MAX_FULL_TOKENS), capped at
max_num_batched_tokens; a step above the largest runs eagerly.

Memory: one pool (the decode graphs'), largest bucket first. The graph type is a parameter so CPU
tests can substitute a recorder (tests/recorded_graph.py); on CPU the reference backend's
static_paged_attention stands in for the kernel.
"""
from __future__ import annotations

import contextlib
from typing import Callable

import torch

from pagedserve.attention import gathered_prefill
from pagedserve.attention.backend import get_backend
from pagedserve.attention.metadata import AttentionMetadata
from pagedserve.runner.piecewise_graphs import GraphLike, token_buckets

MAX_FULL_TOKENS = 8192


def full_token_buckets(max_tokens: int) -> list[int]:
    """Token counts to capture: token_buckets' up to min(max_tokens, MAX_FULL_TOKENS)."""
    return token_buckets(max_tokens, cap=MAX_FULL_TOKENS)


def unified_capacity(device: torch.device, num_tokens: int, num_seqs: int, num_heads: int,
                     num_kv_heads: int) -> tuple[int, int] | None:
    """The attention backend's work capacity for a bucket, or None where it has no unified kernel
    (the reference backend sizes nothing: a non-None marker selects its static path)."""
    ops = get_backend(device)
    capacity = getattr(ops, "unified_capacity", None)
    if capacity is None:
        return (num_tokens, num_tokens)
    return capacity(num_tokens, num_seqs, num_heads, num_kv_heads, device)


class FullCUDAGraphs:
    def __init__(self, model, kv_caches, max_tokens: int, max_seqs: int, max_model_len: int, block_size: int,
                 num_heads: int, num_kv_heads: int, device: torch.device, pool=None,
                 graph_factory: Callable[[], GraphLike] | None = None):
        self.model, self.kv_caches, self.device = model, kv_caches, torch.device(device)
        self.graph_factory = graph_factory or torch.cuda.CUDAGraph
        self.pool = pool
        self.buckets = full_token_buckets(max_tokens)
        if not self.buckets:
            raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
        self.max_seqs, self.block_size = max_seqs, block_size
        self.num_heads, self.num_kv_heads = num_heads, num_kv_heads
        n = self.buckets[-1]
        i32 = dict(dtype=torch.int32, device=self.device)
        self.input_ids = torch.zeros(n, dtype=torch.long, device=self.device)
        self.positions = torch.zeros(n, dtype=torch.long, device=self.device)
        self.slot_mapping = torch.full((n,), -1, dtype=torch.long, device=self.device)
        self.query_start_loc = torch.zeros(max_seqs + 1, **i32)
        self.seq_lens = torch.ones(max_seqs, **i32)
        self.block_tables = torch.zeros(max_seqs, -(-max_model_len // block_size), **i32)
        self.graphs: dict[int, GraphLike] = {}
        self.outputs: dict[int, torch.Tensor] = {}

    def _meta(self, t: int) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:t], query_start_loc=self.query_start_loc, seq_lens=self.seq_lens,
            block_tables=self.block_tables, num_decodes=0, max_query_len=t,
            max_seq_len=self.block_tables.shape[1] * self.block_size, block_size=self.block_size,
            unified_capacity=unified_capacity(self.device, t, self.max_seqs, self.num_heads, self.num_kv_heads))

    @torch.inference_mode()
    def capture(self) -> None:
        cuda = self.device.type == "cuda"
        stream = torch.cuda.Stream(self.device) if cuda else None
        if cuda:
            stream.wait_stream(torch.cuda.current_stream(self.device))
        # Captured with no sequence holding a token: the kernels run, but find no work.
        self.query_start_loc.zero_()
        with torch.cuda.stream(stream) if cuda else contextlib.nullcontext():
            for t in reversed(self.buckets):  # largest first: smaller buckets fit in its pool memory
                args = (self.input_ids[:t], self.positions[:t], self.kv_caches)
                if cuda:
                    self.model(*args, self._meta(t))  # warm-up outside capture: autotuning, lazy init
                    torch.cuda.synchronize(self.device)
                graph = self.graph_factory()
                graph.capture_begin(pool=self.pool)
                # A fresh metadata: the work list the backend builds at the first layer is captured too.
                self.outputs[t] = self.model(*args, self._meta(t))
                graph.capture_end()
                if self.pool is None:
                    self.pool = graph.pool()
                self.graphs[t] = graph
        if cuda:
            torch.cuda.current_stream(self.device).wait_stream(stream)
            torch.cuda.synchronize(self.device)

    @property
    def num_graphs(self) -> int:
        return len(self.graphs)

    def bucket_for(self, num_tokens: int, num_seqs: int) -> int | None:
        if num_seqs > self.max_seqs:
            return None
        for b in self.buckets:
            if b >= num_tokens:
                return b
        return None

    def takes(self, num_tokens: int, num_seqs: int, meta: AttentionMetadata) -> bool:
        """Whether a step replays one of these graphs: a bucket holds it and none of its chunks is
        for the gathered long-prefill path, whose cuDNN over the gathered context beats the unified
        kernel (such a step is long; it runs eagerly, as in piecewise mode)."""
        return (self.bucket_for(num_tokens, num_seqs) is not None
                and not gathered_prefill.step_takes(meta, self.kv_caches[0][0]))

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """The hidden states [num_tokens, hidden] of the step (a view of the bucket's output, valid
        until the next run); bucket_for(num_tokens, num_seqs) must not be None."""
        n, s = input_ids.shape[0], meta.num_seqs
        t = self.bucket_for(n, s)
        if t is None:
            raise ValueError(f"{n} tokens in {s} sequences exceed the largest full graph "
                             f"({self.buckets[-1]} tokens, {self.max_seqs} sequences)")
        self.input_ids[:n].copy_(input_ids, non_blocking=True)
        self.positions[:n].copy_(positions, non_blocking=True)
        self.slot_mapping[:n].copy_(meta.slot_mapping, non_blocking=True)
        self.slot_mapping[n:t].fill_(-1)
        self.query_start_loc[:s + 1].copy_(meta.query_start_loc, non_blocking=True)
        self.query_start_loc[s + 1:].fill_(n)
        self.seq_lens[:s].copy_(meta.seq_lens, non_blocking=True)
        self.seq_lens[s:].fill_(1)
        width = meta.block_tables.shape[1]
        self.block_tables[:s, :width].copy_(meta.block_tables, non_blocking=True)
        self.graphs[t].replay()
        return self.outputs[t][:n]
