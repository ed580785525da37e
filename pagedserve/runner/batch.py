"""One flat batch of tokens from a schedule: input_ids, positions and the AttentionMetadata.

Sequences are concatenated in schedule order (decodes first, then prefill chunks).
Per-token work (positions, slot_mapping) is vectorised in numpy; Python touches each
sequence once. The decode-only case produces tensors whose shapes depend only on the
number of sequences and the block-table width, which is what a CUDA-graph runner needs
(pass pad_blocks_to to pin the width).
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np
import torch

from pagedserve.attention.gathered_prefill_plan import page_runs
from pagedserve.attention.metadata import AttentionMetadata
from pagedserve.core.plan import ScheduledSequence


@dataclass
class ModelInput:
    input_ids: torch.Tensor       # [T] int64
    positions: torch.Tensor       # [T] int64
    attn_meta: AttentionMetadata
    sample_indices: torch.Tensor  # [num_sampling] int64: rows of the hidden states to turn into logits
    num_sampling: int
    # Placeholder tokens (overlapped steps): input_ids[placeholder_dst[i]] is row placeholder_src[i]
    # of the previous step's sampled tokens, filled in on the device (fill_placeholders).
    placeholder_dst: torch.Tensor | None = None
    placeholder_src: torch.Tensor | None = None

    def fill_placeholders(self, prev_sampled: torch.Tensor | None) -> None:
        """Write the previous step's sampled tokens into their input slots, on the device (no sync)."""
        if self.placeholder_dst is None:
            return
        if prev_sampled is None:
            raise ValueError("the batch has placeholder tokens but no previous step's sampled tokens were given")
        self.input_ids.index_copy_(0, self.placeholder_dst, prev_sampled.index_select(0, self.placeholder_src))


def padded_block_tables(block_tables: list[list[int]], table_lens: np.ndarray, width: int) -> np.ndarray:
    """[num_seqs, width] int32, row i = block_tables[i] then zeros; one C-level pass over all entries."""
    num_seqs = len(block_tables)
    total = int(table_lens.sum())
    # fromiter over the chained lists beats np.array(block_tables) even when no row needs padding.
    flat = np.fromiter(itertools.chain.from_iterable(block_tables), dtype=np.int32, count=total)
    if total == num_seqs * width:  # every row is full: no padding to scatter into
        return flat.reshape(num_seqs, width)
    tables = np.zeros((num_seqs, width), dtype=np.int32)
    tables[np.arange(width)[None, :] < table_lens[:, None]] = flat
    return tables


def _to_device(arrays: list[np.ndarray], device: torch.device) -> list[torch.Tensor]:
    """The arrays as tensors on `device`, moved in one host-to-device copy (one staging buffer,
    segments viewed back with their dtype and shape). Segments start at multiples of 16 bytes,
    the alignment Triton specializes kernels on, so every step sees the same variant.
    On CUDA the staging buffer is pinned: a copy from pageable memory this large (block tables
    alone reach 256 KB at 256 sequences) can block the host until the stream reaches it, which
    would make the host wait for the step in flight instead of running ahead of it."""
    sizes = [(a.nbytes + 15) // 16 * 16 for a in arrays]
    total = sum(sizes)
    on_cpu = device.type == "cpu"
    staged = torch.empty(total, dtype=torch.uint8, pin_memory=not on_cpu)
    buf = staged.numpy()
    offsets, off = [], 0
    for a, size in zip(arrays, sizes):
        buf[off:off + a.nbytes] = np.ascontiguousarray(a).reshape(-1).view(np.uint8)
        offsets.append(off)
        off += size
    if not on_cpu:
        staged = staged.to(device, non_blocking=True)
    out = []
    for a, o in zip(arrays, offsets):
        t = staged[o:o + a.nbytes].view(torch.int64 if a.dtype == np.int64 else torch.int32)
        out.append(t if a.ndim == 1 else t.view(a.shape))
    return out


def sample_rows(cu: np.ndarray, sample_mask: np.ndarray, logit_counts: np.ndarray | None) -> np.ndarray:
    """Flat token rows whose logits the step returns, in schedule order: the last token of each
    sampling sequence, or, with logit_counts (speculative rows), the last logit_counts[i] tokens
    of sequence i (1 + k for a row verifying k proposed tokens, 0 for one that does not sample)."""
    if logit_counts is None:
        return cu[1:][sample_mask] - 1
    c = np.asarray(logit_counts, dtype=np.int64)
    total = int(c.sum())
    first_of_seq = np.repeat(cu[1:] - c, c)
    within = np.arange(total, dtype=np.int64) - np.repeat(np.cumsum(c) - c, c)
    return first_of_seq + within


def build_model_input(input_ids: np.ndarray, starts: np.ndarray, query_lens: np.ndarray,
                      block_tables: list[list[int]], sample_mask: np.ndarray, num_decodes: int, block_size: int,
                      device: torch.device, pad_blocks_to: int | None = None,
                      placeholders: tuple[np.ndarray, np.ndarray] | None = None,
                      logit_counts: np.ndarray | None = None) -> ModelInput:
    """The arrays are per sequence except input_ids (per token). Raises if a block table is too short.
    placeholders: (token index, row of the previous step's sampled tokens) pairs, or None.
    logit_counts: see sample_rows (None: one row per sampling sequence)."""
    num_seqs = len(block_tables)
    starts = np.asarray(starts, dtype=np.int64)
    query_lens = np.asarray(query_lens, dtype=np.int64)
    # One token per sequence (all decodes): no per-token expansion, no cumsum.
    sample_mask = np.asarray(sample_mask, dtype=bool)
    decode_only = num_decodes == num_seqs and bool((query_lens == 1).all())
    if decode_only:
        cu = np.arange(num_seqs + 1, dtype=np.int64)
        seq_lens = starts + 1
    else:
        cu = np.zeros(num_seqs + 1, dtype=np.int64)
        np.cumsum(query_lens, out=cu[1:])
        seq_lens = starts + query_lens
    table_lens = np.fromiter(map(len, block_tables), dtype=np.int64, count=num_seqs)
    short = np.nonzero(table_lens * block_size < seq_lens)[0]
    if short.size:
        i = int(short[0])
        raise ValueError(f"block table of scheduled sequence {i} has {table_lens[i]} blocks of {block_size}, "
                         f"too few for {seq_lens[i]} tokens")
    width = int(max(pad_blocks_to or 0, table_lens.max(initial=1)))
    tables = padded_block_tables(block_tables, table_lens, width)
    if decode_only:
        positions = starts
        slots = tables[cu[:-1], positions // block_size].astype(np.int64) * block_size + positions % block_size
        sample_indices = cu[:-1] if sample_mask.all() else cu[1:][sample_mask] - 1
        query_lens_l, seq_lens_l = [1] * num_seqs, seq_lens.tolist()
        max_query_len, max_seq_len = (1 if num_seqs else 0), int(seq_lens.max(initial=0))
        runs = None
    else:
        num_tokens = int(cu[-1])
        seq_of_token = np.repeat(np.arange(num_seqs), query_lens)
        positions = np.arange(num_tokens, dtype=np.int64) - np.repeat(cu[:-1] - starts, query_lens)
        slots = tables[seq_of_token, positions // block_size].astype(np.int64) * block_size + positions % block_size
        sample_indices = sample_rows(cu, sample_mask, logit_counts)
        query_lens_l, seq_lens_l = query_lens.tolist(), seq_lens.tolist()
        max_query_len, max_seq_len = int(max(query_lens_l, default=0)), int(max(seq_lens_l, default=0))
        runs = page_runs(block_tables, query_lens_l, seq_lens_l, num_decodes, block_size)
    arrays = [np.asarray(input_ids, dtype=np.int64), positions, slots, cu.astype(np.int32),
              seq_lens.astype(np.int32), tables, sample_indices]
    if placeholders is not None and len(placeholders[0]):
        arrays += [np.asarray(placeholders[0], dtype=np.int64), np.asarray(placeholders[1], dtype=np.int64)]
    ids_t, pos_t, slots_t, cu_t, seq_lens_t, tables_t, sample_t, *ph = _to_device(arrays, device)
    meta = AttentionMetadata(
        slot_mapping=slots_t,
        query_start_loc=cu_t,
        seq_lens=seq_lens_t,
        block_tables=tables_t,
        num_decodes=num_decodes,
        max_query_len=max_query_len,
        max_seq_len=max_seq_len,
        block_size=block_size,
        query_lens_cpu=query_lens_l,
        seq_lens_cpu=seq_lens_l,
        page_runs=runs,
    )
    return ModelInput(input_ids=ids_t, positions=pos_t, attn_meta=meta,
                      sample_indices=sample_t, num_sampling=int(sample_indices.shape[0]),
                      placeholder_dst=ph[0] if ph else None, placeholder_src=ph[1] if ph else None)


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
    # Decodes whose token is a placeholder: their token index in input_ids (0 there for now) and
    # their row in the previous step's sampled tokens. Empty unless steps overlap.
    placeholder_dst: np.ndarray | None = None
    placeholder_src: np.ndarray | None = None
    # Rows of the flat batch whose logits are returned beside the samples' (prompt_logprobs; see
    # prompt_logprob_spans), None when no scheduled sequence asks.
    prompt_rows: np.ndarray | None = None
    # Speculative steps: logits rows per sequence (sample_rows); None when no row verifies proposals.
    logit_counts: np.ndarray | None = None
    # AttentionMetadata.page_runs, for the incremental path, which drops block_tables (the runner
    # sets it first: ModelRunner.prepare_inputs); build_model_input derives its own from the tables.
    page_runs: dict[int, int] | None = None

    def to_model_input(self, block_size: int, device: torch.device, pad_blocks_to: int | None = None) -> ModelInput:
        ph = None if self.placeholder_dst is None else (self.placeholder_dst, self.placeholder_src)
        return build_model_input(self.input_ids, self.starts, self.query_lens, self.block_tables, self.sample_mask,
                                 self.num_decodes, block_size, device, pad_blocks_to, ph, self.logit_counts)


def _decode_tokens(decodes: list[ScheduledSequence]) -> tuple[list[int], np.ndarray | None, np.ndarray | None]:
    """Each decode's one token (0 for a placeholder), and the placeholders' (index, source row)."""
    ids: list[int] = []
    dst: list[int] = []
    src: list[int] = []
    for i, s in enumerate(decodes):
        seq = s.seq
        if seq.num_inflight_tokens:
            ids.append(0)
            dst.append(i)
            src.append(seq.inflight_sample_row)
        else:
            ids.append(seq.output_token_ids[-1])
    if not dst:
        return ids, None, None
    return ids, np.asarray(dst, dtype=np.int64), np.asarray(src, dtype=np.int64)


def prompt_logprob_spans(scheduled: list[ScheduledSequence], num_decodes: int) -> list[tuple[int, int, int, int]]:
    """(index in scheduled, first flat row, rows, first predicted position) of every prefill chunk
    whose request asks for prompt_logprobs. Row j of a chunk starting at position `start` predicts
    the token at start + j + 1; only prompt positions (< prompt length) are kept."""
    spans, row = [], num_decodes  # decodes come first, one row each
    for i in range(num_decodes, len(scheduled)):
        s = scheduled[i]
        if s.group.sampling_params.prompt_logprobs is not None:
            count = max(0, min(s.num_new_tokens, len(s.seq.prompt_token_ids) - 1 - s.start))
            if count:
                spans.append((i, row, count, s.start + 1))
        row += s.num_new_tokens
    return spans


def host_batch(scheduled: list[ScheduledSequence], num_decodes: int) -> HostBatch:
    """The host arrays of one SchedulerOutput's scheduled sequences (in their order)."""
    n = len(scheduled)
    starts = np.fromiter([s.start for s in scheduled], dtype=np.int64, count=n)
    if num_decodes == n:
        # Decode-only step: one token each, the last one appended, and every sequence samples.
        query_lens = np.ones(n, dtype=np.int64)
        sample_mask = np.ones(n, dtype=bool)
        ids, dst, src = _decode_tokens(scheduled)
    else:
        query_lens = np.fromiter([s.num_new_tokens for s in scheduled], dtype=np.int64, count=n)
        sample_mask = np.fromiter([s.do_sample for s in scheduled], dtype=bool, count=n)
        ids, dst, src = _decode_tokens(scheduled[:num_decodes])
        spec = False
        for s in scheduled[num_decodes:]:
            if s.seq.num_inflight_tokens:
                raise ValueError("a prefill chunk must not contain a placeholder token")
            k = s.num_lookahead
            if k:  # a speculative row: its last token, then the proposed ones
                spec = True
                ids.extend(s.seq.token_slice(s.start, s.start + s.num_new_tokens - k))
                ids.extend(s.seq.spec_token_ids[:k])
            else:
                ids.extend(s.seq.token_slice(s.start, s.start + s.num_new_tokens))
        if len(ids) != int(query_lens.sum()):
            raise ValueError("a scheduled sequence asks for tokens beyond its length")
    spans = prompt_logprob_spans(scheduled, num_decodes) if num_decodes < n else []
    rows = np.concatenate([np.arange(r, r + c) for _, r, c, _ in spans]) if spans else None
    counts = None
    if num_decodes < n and spec:
        counts = sample_mask.astype(np.int64) + np.fromiter([s.num_lookahead for s in scheduled], np.int64, count=n)
    return HostBatch(np.asarray(ids, dtype=np.int64), starts, query_lens, [s.block_table for s in scheduled],
                     sample_mask, num_decodes, dst, src, rows, counts)
