"""Long prefill chunks through cuDNN's attention over their gathered context (PAGEDSERVE_LONG_PREFILL=cudnn).

At long contexts nearly all of a prefill's time is its attention, and there our Triton prefill
kernel runs at ~0.7x FlashAttention-3's speed (docs/long-context.md). cuDNN's fused attention
does not read a block table, so a long chunk takes this path instead:

A chunk of c new tokens after P earlier ones attends (1) to the P earlier tokens, unmasked, and
(2) to its own c tokens, causally. At long contexts (1) is nearly all of it (P * c against c * c / 2).
(1) The prefix's K/V are gathered out of their pages into one contiguous buffer, heads first
    (~2 KB a token a layer for Llama-3.1-8B: 0.4 GB at 100k, a fraction of a millisecond), and
    handed to cuDNN with each KV group's query heads folded into the query length, so K/V are
    read once per group and never repeated. cuDNN builds an execution plan per shape, and a long
    prefill meets a new context length every step: the prefix is padded with zeros to a multiple
    of PREFIX_BUCKET and the pad masked by one broadcast bias row, the folded queries to a
    multiple of QUERY_BUCKET tokens, so serving meets only the bucketed shapes, whose plans the
    warm-up builds (warm_up_plans; nothing is built after start-up).
(2) torch's flash kernel, causal over the chunk's own K/V (top-left and lower-right agree on a square;
    it builds no plans).
The two are merged by their log-sum-exps. Chunks shorter than MIN_CHUNK or after fewer than
MIN_PREFIX tokens stay on the Triton kernel (where the pad would cost more than it saves).

The prefix parts go through `prefix_attention(q [1, Hkv, R, D], k [1, Hkv, S, D], v, bias [1, 1, 1, S],
scale)` -> (out, lse [.., R]) and the squares through `square_attention(q [1, H, c, D], k, v, scale)`
-> (out, lse): on
CUDA cuDNN's and flash's ops; CPU tests pass their own.
"""
from __future__ import annotations

import os

import torch

LONG_PREFILL_ENV = "PAGEDSERVE_LONG_PREFILL"
PREFIX_BUCKET = 8192
QUERY_BUCKET = 1024
MIN_PREFIX = 16384
MIN_CHUNK = 1024


def enabled() -> bool:
    value = os.environ.get(LONG_PREFILL_ENV, "")
    if value not in ("", "0", "cudnn"):
        raise ValueError(f"{LONG_PREFILL_ENV}={value!r}: expected 'cudnn' or unset")
    return value == "cudnn"


def takes(query_len: int, seq_len: int) -> bool:
    """Whether a prefill chunk of query_len new tokens ending at seq_len takes this path."""
    return query_len >= MIN_CHUNK and seq_len - query_len >= MIN_PREFIX


def long_chunks(meta, k_cache: torch.Tensor) -> list[int]:
    """The step's prefill sequences (indices) that take this path: from the host lengths, never a
    sync; none from an fp8 pool (its scales are the Triton kernels')."""
    if meta.query_lens_cpu is None or meta.seq_lens_cpu is None or k_cache.element_size() == 1:
        return []
    return [i for i in range(meta.num_decodes, meta.num_seqs) if takes(meta.query_lens_cpu[i], meta.seq_lens_cpu[i])]


def other_ranges(first: int, end: int, skip: list[int]) -> list[tuple[int, int]]:
    """[first, end) less the sequences in skip, as (first, count) runs of consecutive sequences."""
    runs, start = [], first
    for i in sorted(skip) + [end]:
        if i > start:
            runs.append((start, i - start))
        start = i + 1
    return runs


def bucket(n: int, step: int) -> int:
    return -(-n // step) * step


def cudnn_prefix(q, k, v, bias, scale):
    return torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, bias.expand(1, q.shape[1], q.shape[2], -1),
                                                              True, 0.0, False, False, scale=scale)[:2]


def flash_square(q, k, v, scale):
    return torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, True, False, scale=scale)[:2]


class GatheredPrefill:
    """The gather buffers of one pool layout, sized for max_model_len and made before the KV pool
    is sized (so the start-up profile counts them); shared by all layers, which run one at a time."""

    def __init__(self, max_model_len: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device, prefix_attention=cudnn_prefix, square_attention=flash_square):
        span = bucket(max_model_len, PREFIX_BUCKET)
        # Zeros: the pad past a prefix is masked, but a NaN there would still poison 0 * NaN.
        self.k = torch.zeros(1, num_kv_heads, span, head_dim, dtype=dtype, device=device)
        self.v = torch.zeros_like(self.k)
        self.bias = torch.zeros(1, 1, 1, span, dtype=dtype, device=device)
        self.prefix_attention, self.square_attention = prefix_attention, square_attention
        self.max_model_len = max_model_len

    def attend(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, table: torch.Tensor,
               seq_len: int, scale: float) -> torch.Tensor:
        """q [c, H, D], the chunk's last token at position seq_len - 1, its K/V already in the pool
        (table: its block table row); its causal attention over its context, [c, H, D]."""
        c, H, D = q.shape
        prefix, bs, kv_heads = seq_len - c, k_cache.shape[1], k_cache.shape[2]
        group = H // kv_heads
        pages = table[: -(-seq_len // bs)].long()
        # (1) the prefix, gathered heads first into the padded buffer; the pad's bias is -inf.
        span = bucket(prefix, PREFIX_BUCKET)
        for pool, buf in ((k_cache, self.k), (v_cache, self.v)):
            ctx = pool.index_select(0, pages).flatten(0, 1)  # [pages * bs, Hkv, D]
            buf[0, :, :prefix].copy_(ctx[:prefix].transpose(0, 1))
            buf[0, :, prefix:span].zero_()
            if buf is self.k:
                square_k = ctx[prefix:seq_len]
            else:
                square_v = ctx[prefix:seq_len]
        self.bias[..., :prefix] = 0.0
        self.bias[..., prefix:span] = float("-inf")
        rows = bucket(c, QUERY_BUCKET)
        folded = q.new_zeros(kv_heads, group, rows, D)
        folded[:, :, :c] = q.view(c, kv_heads, group, D).permute(1, 2, 0, 3)
        out1, lse1 = self.prefix_attention(folded.view(1, kv_heads, group * rows, D), self.k[:, :, :span],
                                           self.v[:, :, :span], self.bias[..., :span], scale)
        out1 = out1.reshape(kv_heads, group, rows, D)[:, :, :c].reshape(H, c, D)
        lse1 = lse1.reshape(kv_heads, group, rows)[:, :, :c].reshape(H, c)
        # (2) the chunk's own square, causal, K/V repeated over the group (c x c: small).
        heads_first = q.transpose(0, 1).unsqueeze(0)
        sk, sv = (x.repeat_interleave(group, dim=1).transpose(0, 1).unsqueeze(0) for x in (square_k, square_v))
        out2, lse2 = self.square_attention(heads_first, sk, sv, scale)
        return merge(out1, lse1, out2[0], lse2.reshape(H, c)).transpose(0, 1)

    def shapes(self, max_tokens: int) -> list[tuple[int, int]]:
        """Every (query rows, prefix span) a chunk can meet: the plans warm_up_plans builds."""
        spans = range(bucket(MIN_PREFIX, PREFIX_BUCKET), bucket(self.max_model_len - MIN_CHUNK, PREFIX_BUCKET) + 1,
                      PREFIX_BUCKET)
        rows = range(QUERY_BUCKET, bucket(max_tokens, QUERY_BUCKET) + 1, QUERY_BUCKET)
        return [(r, s) for r in rows for s in spans]


def warm_up_plans(g: GatheredPrefill, max_tokens: int, num_heads: int, scale: float) -> int:
    """Run the prefix op once at every shape of g.shapes(max_tokens) (cuDNN builds and caches each
    one's plan) and the square op once (its kernels load on first use); returns the shapes run."""
    _, kv_heads, _, head_dim = g.k.shape
    group = num_heads // kv_heads
    shapes = g.shapes(max_tokens)
    for rows, span in shapes:
        q = g.k.new_zeros(1, kv_heads, group * rows, head_dim)
        g.prefix_attention(q, g.k[:, :, :span], g.v[:, :, :span], g.bias[..., :span], scale)
    sq = g.k.new_zeros(1, num_heads, QUERY_BUCKET, head_dim)
    g.square_attention(sq, sq, sq, scale)
    return len(shapes)


def merge(out1, lse1, out2, lse2) -> torch.Tensor:
    """Two softmax attentions of the same queries over disjoint keys ([H, c, D] with [H, c]
    log-sum-exps) as the attention over their union, in float32."""
    lse1, lse2 = lse1.float(), lse2.float()
    m = torch.maximum(lse1, lse2)
    w1, w2 = (lse1 - m).exp().unsqueeze(-1), (lse2 - m).exp().unsqueeze(-1)
    return ((out1.float() * w1 + out2.float() * w2) / (w1 + w2)).to(out1.dtype)
