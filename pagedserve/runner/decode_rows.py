"""Short prefills as decode rows, so that a step that carries one replays a decode CUDA graph.

Why: under serving load most steps that carry prefill carry a little of it (a new short prompt:
14 tokens at the median over the H200 steps of `launch_ab` at 1246ea2) beside tens of decodes.
Such a step ran as piecewise graphs with attention launched eagerly per layer
(piecewise_graphs.py) and took 8-11 ms at the median against 5.3-5.5 ms for a decode-only step
of the same batch: the host's launches, not the GPU, set its length.

How: causal attention of a chunk's token at position p reads positions 0..p of its sequence,
which is what the decode kernel computes for a row whose context is p + 1 tokens. So the step's
metadata is rewritten with one row per token: each token's own context length, its sequence's
block table, query length 1. Nothing else in the forward sees sequences (every other op works
row by row), the token order is unchanged (sample indices and the slot mapping stay valid), and
the K/V of every token is written before the layer attends (Attention.attend), so the chunk's
later tokens see its earlier ones. The step then replays the decode graph of its token count.

Not for long chunks or chunks over long contexts: every row reads its whole context, where the
prefill kernel reads it once per 64 queries. A step qualifies while its prefill tokens are at most
MAX_PREFILL_TOKENS and the positions they read in total at most MAX_PREFILL_POSITIONS (what a
decode step of 64 sequences of 1k tokens reads).
PAGEDSERVE_SHORT_PREFILL_GRAPHS=0 turns it off (A/B runs).
"""
from __future__ import annotations

import os
from dataclasses import replace

import torch

from pagedserve.attention.metadata import AttentionMetadata

SHORT_PREFILL_ENV = "PAGEDSERVE_SHORT_PREFILL_GRAPHS"
MAX_PREFILL_TOKENS = 128
MAX_PREFILL_POSITIONS = 64 * 1024


def short_prefill_graphs_enabled() -> bool:
    """PAGEDSERVE_SHORT_PREFILL_GRAPHS: "1" (the default) on, "0" off."""
    mode = os.environ.get(SHORT_PREFILL_ENV, "1").strip()
    if mode not in ("0", "1"):
        raise ValueError(f"{SHORT_PREFILL_ENV} must be 0 or 1, got {mode!r}")
    return mode == "1"


def as_decode_rows(meta: AttentionMetadata, positions: torch.Tensor,
                   max_prefill_tokens: int = MAX_PREFILL_TOKENS,
                   max_prefill_positions: int = MAX_PREFILL_POSITIONS) -> AttentionMetadata | None:
    """The step's metadata with one decode row per token (positions: each token's position, on
    the device), or None when the step has no prefill, its host copies are missing, or its
    prefill exceeds the limits above. No device sync: the rows' lengths come from the host copies."""
    q_lens, s_lens = meta.query_lens_cpu, meta.seq_lens_cpu
    nd, ns = meta.num_decodes, meta.num_seqs
    if q_lens is None or s_lens is None or nd == ns:
        return None
    num_tokens = positions.shape[0]
    prefill_tokens = num_tokens - nd
    if prefill_tokens > max_prefill_tokens:
        return None
    # Row lengths on the host: a chunk of q tokens ending at context s has rows s-q+1 .. s.
    row_lens = list(s_lens[:nd])
    for q, s in zip(q_lens[nd:], s_lens[nd:]):
        row_lens.extend(range(s - q + 1, s + 1))
    if sum(row_lens[nd:]) > max_prefill_positions:
        return None
    device = positions.device
    query_lens = meta.query_start_loc[1:] - meta.query_start_loc[:-1]
    seq_of_token = torch.repeat_interleave(torch.arange(ns, device=device), query_lens, output_size=num_tokens)
    return replace(
        meta,
        query_start_loc=torch.arange(num_tokens + 1, dtype=torch.int32, device=device),
        seq_lens=(positions + 1).to(torch.int32),
        block_tables=meta.block_tables.index_select(0, seq_of_token),
        num_decodes=num_tokens, max_query_len=1, max_seq_len=max(row_lens),
        query_lens_cpu=[1] * num_tokens, seq_lens_cpu=row_lens,
        decode_split_tokens=None, decode_order=None, window_lens={}, unified_work=None)
