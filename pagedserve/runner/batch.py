"""One flat batch of tokens from a schedule: input_ids, positions and the AttentionMetadata.

Sequences are concatenated in schedule order (decodes first, then prefill chunks).
Per-token work (positions, slot_mapping) is vectorised in numpy; Python touches each
sequence once. The decode-only case produces tensors whose shapes depend only on the
number of sequences and the block-table width, which is what a CUDA-graph runner needs
(pass pad_blocks_to to pin the width).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from pagedserve.attention.metadata import AttentionMetadata
from pagedserve.core.plan import ScheduledSequence


@dataclass
class ModelInput:
    input_ids: torch.Tensor       # [T] int64
    positions: torch.Tensor       # [T] int64
    attn_meta: AttentionMetadata
    sample_indices: torch.Tensor  # [num_sampling] int64: rows of the hidden states to turn into logits
    num_sampling: int


def _new_tokens(s: ScheduledSequence) -> list[int]:
    seq, lo, hi = s.seq, s.start, s.start + s.num_new_tokens
    p = len(seq.prompt_token_ids)
    if lo >= p:
        return seq.output_token_ids[lo - p:hi - p]
    if hi <= p:
        return seq.prompt_token_ids[lo:hi]
    return seq.prompt_token_ids[lo:] + seq.output_token_ids[:hi - p]


def build_model_input(input_ids: np.ndarray, starts: np.ndarray, query_lens: np.ndarray,
                      block_tables: list[list[int]], sample_mask: np.ndarray, num_decodes: int, block_size: int,
                      device: torch.device, pad_blocks_to: int | None = None) -> ModelInput:
    """The arrays are per sequence except input_ids (per token). Raises if a block table is too short."""
    num_seqs = len(block_tables)
    cu = np.zeros(num_seqs + 1, dtype=np.int64)
    np.cumsum(query_lens, out=cu[1:])
    seq_lens = starts + query_lens
    table_lens = np.fromiter((len(t) for t in block_tables), dtype=np.int64, count=num_seqs)
    short = np.nonzero(table_lens * block_size < seq_lens)[0]
    if short.size:
        i = int(short[0])
        raise ValueError(f"block table of scheduled sequence {i} has {table_lens[i]} blocks of {block_size}, "
                         f"too few for {seq_lens[i]} tokens")
    width = int(max(pad_blocks_to or 0, table_lens.max(initial=1)))
    tables = np.zeros((num_seqs, width), dtype=np.int32)
    for i, t in enumerate(block_tables):
        tables[i, :len(t)] = t
    seq_of_token = np.repeat(np.arange(num_seqs), query_lens)
    positions = np.arange(cu[-1], dtype=np.int64) - np.repeat(cu[:-1] - starts, query_lens)
    slots = tables[seq_of_token, positions // block_size].astype(np.int64) * block_size + positions % block_size
    sample_indices = cu[1:][sample_mask] - 1

    def dev(a: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
        t = torch.from_numpy(np.ascontiguousarray(a)).to(dtype)
        return t.to(device, non_blocking=True) if device.type != "cpu" else t

    query_lens_l, seq_lens_l = query_lens.tolist(), seq_lens.tolist()
    meta = AttentionMetadata(
        slot_mapping=dev(slots, torch.int64),
        query_start_loc=dev(cu, torch.int32),
        seq_lens=dev(seq_lens, torch.int32),
        block_tables=dev(tables, torch.int32),
        num_decodes=num_decodes,
        max_query_len=int(max(query_lens_l, default=0)),
        max_seq_len=int(max(seq_lens_l, default=0)),
        block_size=block_size,
        query_lens_cpu=query_lens_l,
        seq_lens_cpu=seq_lens_l,
    )
    return ModelInput(input_ids=dev(input_ids, torch.int64), positions=dev(positions, torch.int64), attn_meta=meta,
                      sample_indices=dev(sample_indices, torch.int64), num_sampling=int(sample_indices.shape[0]))


@dataclass
class HostBatch:
    """One step's flat batch as host arrays, before any device tensor exists.

    This is what a tensor-parallel rank 0 sends to every rank (it pickles small: no
    Sequence objects, only the new tokens); each rank then builds its own device tensors.
    """
    input_ids: np.ndarray          # [T] int64, the new tokens of every scheduled sequence
    starts: np.ndarray             # [S] int64, first position computed this step
    query_lens: np.ndarray         # [S] int64
    block_tables: list[list[int]]  # [S] physical block ids
    sample_mask: np.ndarray        # [S] bool, sequences that sample a token this step
    num_decodes: int

    def to_model_input(self, block_size: int, device: torch.device, pad_blocks_to: int | None = None) -> ModelInput:
        return build_model_input(self.input_ids, self.starts, self.query_lens, self.block_tables, self.sample_mask,
                                 self.num_decodes, block_size, device, pad_blocks_to)


def host_batch(scheduled: list[ScheduledSequence], num_decodes: int) -> HostBatch:
    """The host arrays of one SchedulerOutput's scheduled sequences (in their order)."""
    n = len(scheduled)
    starts = np.fromiter((s.start for s in scheduled), dtype=np.int64, count=n)
    query_lens = np.fromiter((s.num_new_tokens for s in scheduled), dtype=np.int64, count=n)
    sample_mask = np.fromiter((s.do_sample for s in scheduled), dtype=bool, count=n)
    ids: list[int] = []
    for s in scheduled:
        ids.extend(_new_tokens(s))
    if len(ids) != int(query_lens.sum()):
        raise ValueError("a scheduled sequence asks for tokens beyond its length")
    return HostBatch(np.asarray(ids, dtype=np.int64), starts, query_lens, [s.block_table for s in scheduled],
                     sample_mask, num_decodes)


def prepare_model_input(scheduled: list[ScheduledSequence], num_decodes: int, block_size: int,
                        device: torch.device, pad_blocks_to: int | None = None) -> ModelInput:
    """The batch for one SchedulerOutput's scheduled sequences (in their order)."""
    return host_batch(scheduled, num_decodes).to_model_input(block_size, device, pad_blocks_to)
