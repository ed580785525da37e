"""The draft model's decode steps of one round, their metadata advanced on the device.

After the catch-up forward has given proposal 1 of every active request, proposals 2..k come from
k - 1 decode forwards of one token per request. Everything those forwards read is known when the
round starts: request r's first decode input sits at position n_r (its verified length), each
step one further, and it may write KV up to position last_r = n_r + k_r - 2 (its blocks were
reserved for proposals 1..k_r - 1). So the host uploads the round's state once (positions, last
writable positions, block tables: one host-to-device copy) and each step advances it with a few
device ops: the previous draws become the inputs, positions and lengths grow by one, the slots are
looked up in the block tables. No step reads the device from the host (the proposer reads every
draw once, at the end of the round), and on CUDA each step replays the draft's decode graph of
the batch's bucket over these buffers in place (runner/cuda_graph.DecodeCUDAGraphs.replay), so a
step costs the host a replay and a handful of launches whatever the batch.

Rows keep their place for the whole round: a request with k_r below the round's largest k stops
writing after its last proposal (slot -1; its position and length stop growing) and its row's later
draws are discarded, instead of the batch shrinking, which would need the host to gather new
tensors. Its extra work is what a padded graph row costs.

Invariants, for row r at step s = 1..steps:
- its input position is min(n_r + s - 1, last_r), always < max_model_len (rotary tables);
- it writes KV at that position iff n_r + s - 1 <= last_r, into the slot its block table gives;
- its context length is that position + 1: a row that is done reads only KV it wrote;
- seq_lens_cpu (the host's copy, for the attention's launch plan) equals the device's seq_lens.
"""
from __future__ import annotations

import numpy as np
import torch

from pagedserve.attention.metadata import AttentionMetadata
from pagedserve.runner.batch import _to_device, padded_block_tables


class DraftDecodeSteps:
    """One round's decode steps over `b` rows (see the module docstring).

    model, kv_caches: the draft's; graphs: its DecodeCUDAGraphs or None (CPU, enforce_eager): a
    batch with no bucket runs eagerly over tensors of its own, with the same metadata."""

    def __init__(self, model, kv_caches, block_size: int, graphs, device: torch.device,
                 positions: np.ndarray, last: np.ndarray, block_tables: list[list[int]]):
        self.model, self.kv_caches, self.block_size = model, kv_caches, block_size
        b = self.b = len(block_tables)
        lens = np.fromiter(map(len, block_tables), dtype=np.int64, count=b)
        if (lens * block_size <= last).any():
            raise ValueError("draft decode steps: a block table is too short for its last position")
        width = int(lens.max(initial=1))
        tables = padded_block_tables(block_tables, lens, width)
        # Step 0 is "before the first step": positions one short, advanced by step().
        start = np.asarray(positions, dtype=np.int64) - 1
        self.host_next, self.host_last = start, np.asarray(last, dtype=np.int64)
        next_t, last_t, tables_t = _to_device([start, self.host_last, tables], device)  # the round's one upload
        self.next, self.last = next_t, last_t
        self.graphs = graphs if graphs is not None and graphs.bucket_for(b) is not None else None
        if self.graphs is not None:  # the graph's static buffers, written in place
            g = self.graphs
            self.input_ids, self.positions = g.input_ids[:b], g.positions[:b]
            self.slot_mapping, self.seq_lens = g.slot_mapping[:b], g.seq_lens[:b]
            self.block_tables = g.block_tables[:b]
            self.block_tables[:, :width].copy_(tables_t, non_blocking=True)
        else:
            self.input_ids = torch.empty(b, dtype=torch.long, device=device)
            self.positions = torch.empty(b, dtype=torch.long, device=device)
            self.slot_mapping = torch.empty(b, dtype=torch.long, device=device)
            self.seq_lens = torch.empty(b, dtype=torch.int32, device=device)
            self.block_tables = tables_t
            self.query_start_loc = torch.arange(b + 1, dtype=torch.int32, device=device)

    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        """The next decode step with `tokens` ([b], on the device: the previous draws) as inputs;
        returns its logits [b, vocab]."""
        bs = self.block_size
        self.next += 1
        self.host_next += 1
        torch.minimum(self.next, self.last, out=self.positions)
        self.seq_lens.copy_(self.positions + 1)
        block = self.block_tables.gather(1, torch.div(self.positions, bs, rounding_mode="floor")[:, None])
        slots = block.squeeze(1).to(torch.long) * bs + self.positions % bs
        self.slot_mapping.copy_(slots.masked_fill_(self.next > self.last, -1))
        self.input_ids.copy_(tokens)
        seq_lens_cpu = (np.minimum(self.host_next, self.host_last) + 1).tolist()
        if self.graphs is not None:
            hidden = self.graphs.replay(self.b, seq_lens_cpu)
        else:
            meta = AttentionMetadata(
                slot_mapping=self.slot_mapping, query_start_loc=self.query_start_loc, seq_lens=self.seq_lens,
                block_tables=self.block_tables, num_decodes=self.b, max_query_len=1,
                max_seq_len=max(seq_lens_cpu), block_size=bs, query_lens_cpu=[1] * self.b,
                seq_lens_cpu=seq_lens_cpu)
            hidden = self.model(self.input_ids, self.positions, self.kv_caches, meta)
        return self.model.compute_logits(hidden)
