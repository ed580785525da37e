"""CUDA graphs for decode steps, one per batch-size bucket.

A decode step of a small model is a few hundred tiny kernels; replaying them as one
graph removes the launch cost that otherwise dominates. Every tensor the graph reads
lives in a static buffer sized for the largest bucket; a step copies its inputs into
the first B rows and pads the rest so that padding writes nothing (slot -1) and
attends to one token of block 0. The attention backend is captured with max_seq_len
fixed to max_model_len, so its launch grid does not depend on the step. A backend with a decode
plan (triton_ops.decode_plan) may ask for one graph per decode split mode (graph_split_modes:
balanced splits, and also none, and in the slots' grid where it differs) and pick one for each
step from the host's lengths (pick_split_mode). Buckets of at least nano_batch_rows rows are captured
as two nano-batches of half_rows(bucket) rows and the rest (models/nano_batches.py: one's attention
on a second stream beside the other's matmuls), their split modes those of the first half.
"""
from __future__ import annotations

import torch

from pagedserve.attention.backend import get_backend
from pagedserve.attention.metadata import AttentionMetadata
from pagedserve.models.nano_batches import NanoStreams, forward_in_halves, half_rows


def graph_capturable(model) -> bool:
    """False if some module says it cannot run inside a CUDA graph (graph_capturable = False:
    the torch MoE path, which reads the routing on the host); such models run eagerly."""
    return all(getattr(m, "graph_capturable", True) for m in model.modules())


def batch_buckets(max_batch: int, sizes: list[int] | None = None) -> list[int]:
    """The decode batch sizes to capture: `sizes` (EngineConfig.cuda_graph_sizes) up to
    max_batch, or by default vLLM's: 1, 2, 4, every 8 up to 256, every 16 above, and max_batch.
    A batch between two sizes pads to the larger, and the graph runs every layer over the padded
    rows. Against every 16 (ours before) the step of 8 measured no different on the H200 at 24-96
    sequences of Llama-3.1-8B, where the GEMMs read every weight whatever the rows; it is kept so
    that a batch pads as it would in vLLM."""
    if sizes is not None:
        return sorted({b for b in sizes if b <= max_batch})
    default = [1, 2, 4] + list(range(8, 257, 8)) + list(range(272, max_batch + 1, 16))
    return sorted({b for b in default if b <= max_batch} | {max_batch})


class DecodeCUDAGraphs:
    def __init__(self, model, kv_caches, buckets: list[int], max_model_len: int, block_size: int,
                 device: torch.device, num_kv_heads: int = 1, nano_batch_rows: int = 0, sm_carveout: int = 0):
        """buckets: the batch sizes to capture, ascending (batch_buckets), at least one.
        nano_batch_rows: buckets of at least this many rows (and 2) run as two nano-batches (0: none),
        their matmuls leaving sm_carveout SMs to the attention beside them (matmul_sm_carveout)."""
        self.model, self.kv_caches = model, kv_caches
        self.max_model_len, self.block_size = max_model_len, block_size
        self.buckets = buckets
        self.num_kv_heads, self.device = num_kv_heads, device
        self.nano = {b for b in buckets if nano_batch_rows and b >= max(nano_batch_rows, 2)}
        self.sm_carveout = sm_carveout
        self.nano_streams = NanoStreams(device) if self.nano and device.type == "cuda" else None
        plan = getattr(get_backend(device), "decode_plan", None)
        # bucket -> the split modes captured for it, the first its default (the tiles counted as the
        # launch over this cache walks them, as the pick in replay counts them); a nano-batched
        # bucket's are its first half's (half_rows(bucket) rows; the second has up to 3 more)
        kv_dtype = kv_caches[0][0].dtype if plan and kv_caches else None
        self.split_modes: dict[int, list[int | None]] = {
            b: plan.graph_split_modes(self._rows_per_launch(b), num_kv_heads, max_model_len, device,
                                      kv_dtype=kv_dtype) if plan else [None]
            for b in buckets}
        self.pick_split_mode = plan.pick_split_mode if plan else None
        max_blocks = (max_model_len + block_size - 1) // block_size
        n = self.buckets[-1]
        i32 = dict(dtype=torch.int32, device=device)
        self.input_ids = torch.zeros(n, dtype=torch.long, device=device)
        self.positions = torch.zeros(n, dtype=torch.long, device=device)
        self.slot_mapping = torch.full((n,), -1, dtype=torch.long, device=device)
        self.seq_lens = torch.ones(n, **i32)
        self.block_tables = torch.zeros(n, max_blocks, **i32)
        self.query_start_loc = torch.arange(n + 1, **i32)
        self.graphs: dict[tuple[int, int | None], torch.cuda.CUDAGraph] = {}  # (bucket, split mode)
        self.outputs: dict[tuple[int, int | None], torch.Tensor] = {}
        self.pool = None

    def _rows_per_launch(self, b: int) -> int:
        return half_rows(b) if b in self.nano else b

    def _forward(self, b: int, split_mode: int | None) -> torch.Tensor:
        args = (self.input_ids[:b], self.positions[:b], self.kv_caches, self._meta(b, split_mode))
        if b not in self.nano:
            return self.model(*args)
        return forward_in_halves(self.model, *args, self.nano_streams, self.sm_carveout)

    def _meta(self, b: int, split_mode: int | None) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:b], query_start_loc=self.query_start_loc[:b + 1],
            seq_lens=self.seq_lens[:b], block_tables=self.block_tables[:b], num_decodes=b,
            max_query_len=1, max_seq_len=self.max_model_len, block_size=self.block_size,
            decode_split_tokens=split_mode)

    @torch.inference_mode()
    def capture(self) -> None:
        stream = torch.cuda.Stream()
        # largest first, so smaller graphs reuse its memory pool
        for b, mode in [(b, mode) for b in reversed(self.buckets) for mode in self.split_modes[b]]:
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                self._forward(b, mode)  # warm-up outside capture: autotuning and lazy init
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            # A fresh metadata: what the backend derives per step (decode_order) is captured too.
            with torch.cuda.graph(graph, pool=self.pool):
                self.outputs[b, mode] = self._forward(b, mode)
            self.pool = graph.pool()
            self.graphs[b, mode] = graph
        torch.cuda.synchronize()

    def bucket_for(self, batch: int) -> int | None:
        for b in self.buckets:
            if b >= batch:
                return b
        return None

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Replay the graph of the smallest bucket >= batch; returns hidden states [batch, hidden]."""
        b = input_ids.shape[0]
        self.input_ids[:b].copy_(input_ids, non_blocking=True)
        self.positions[:b].copy_(positions, non_blocking=True)
        self.slot_mapping[:b].copy_(meta.slot_mapping, non_blocking=True)
        self.seq_lens[:b].copy_(meta.seq_lens, non_blocking=True)
        width = meta.block_tables.shape[1]
        self.block_tables[:b, :width].copy_(meta.block_tables, non_blocking=True)
        return self.replay(b, meta.seq_lens_cpu)

    def replay(self, b: int, seq_lens_cpu: list[int] | None = None) -> torch.Tensor:
        """Replay the graph of the smallest bucket >= b over the static buffers as they stand: the
        caller wrote rows :b of input_ids, positions, slot_mapping, seq_lens and block_tables (run()
        copies them from a step's tensors; a caller that advances them on the device, as the draft
        model's decode steps do, writes them in place). Rows b.. of the bucket are padded here so
        that they write nothing. seq_lens_cpu (the rows' lengths on the host) picks the split mode.
        Returns the hidden states [b, hidden]."""
        g = self.bucket_for(b)
        self.slot_mapping[b:g].fill_(-1)
        self.seq_lens[b:g].fill_(1)
        modes = self.split_modes[g]
        mode = modes[0]
        if len(modes) > 1 and seq_lens_cpu is not None:
            # The tiles are counted as the launch over this cache walks them (an fp8 cache has its own).
            rows = self._rows_per_launch(g)  # a nano-batched bucket's first half
            mode = self.pick_split_mode(seq_lens_cpu[:rows], rows, self.num_kv_heads, self.max_model_len,
                                        self.device, kv_dtype=self.kv_caches[0][0].dtype)
        self.graphs[g, mode].replay()
        return self.outputs[g, mode][:b]
