"""AttentionMetadata: everything an attention backend needs for one flat batch.

The batch is flattened: tokens of all sequences are concatenated, decodes first
(one token each), then prefill chunks. Sequence i owns query tokens
[query_start_loc[i], query_start_loc[i+1]) and, after this step's K/V are written,
has seq_lens[i] tokens of context, read only through block_tables[i].
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor      # [num_tokens] int64: block_id * block_size + offset; -1 = do not write
    query_start_loc: torch.Tensor   # [num_seqs + 1] int32, cumulative query lengths
    seq_lens: torch.Tensor          # [num_seqs] int32, context length after this step
    block_tables: torch.Tensor      # [num_seqs, max_blocks_per_seq] int32, padded with 0
    num_decodes: int                # the first num_decodes sequences have exactly one query token
    max_query_len: int
    max_seq_len: int
    block_size: int
    # Host copies, so backends never sync the device to learn shapes.
    query_lens_cpu: list[int] | None = None
    seq_lens_cpu: list[int] | None = None
    # Prefill sequences (index -> first block id) whose long chunk's pages lie in one run of the
    # pool (gathered_prefill_plan.page_runs, from the host's tables): the long-prefill path reads them
    # in place instead of gathering them. None: none.
    page_runs: dict[int, int] | None = None
    # The decode kernels' split mode (decode_plan.decode_split_tokens' values), fixed by a decode
    # CUDA graph at capture; None: the backend's own choice.
    decode_split_tokens: int | None = None
    # The decode rows longest first (triton_ops.paged_attention sorts seq_lens once per step, at the
    # first layer, and every layer reuses it; a decode graph captures the sort with the step).
    decode_order: torch.Tensor | None = None
    # Set: the step takes the unified kernel (triton_unified.py) with work buffers of this
    # (max q tiles, items) capacity (work_capacity of the token-count bucket), so that its launch
    # shapes never depend on the step's lengths (a full CUDA graph captures it per bucket).
    unified_capacity: tuple[int, int] | None = None
    # The work lists (one per sliding window, 0: none) and split buffers, built at the first layer
    # from the lengths on the device and reused by every later layer of the step (as decode_order).
    unified_work: dict | None = None
    # The decode rows' lengths clamped to each sliding window (window -> tensor), likewise reused.
    window_lens: dict = field(default_factory=dict)

    @property
    def num_seqs(self) -> int:
        return self.seq_lens.shape[0]
