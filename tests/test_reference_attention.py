"""The reference paged attention equals dense causal SDPA on the same tokens, whatever the paging,
with a sliding window too (HF's mask: a token sees itself and the window - 1 positions before it),
and with Gemma 2's soft-capped scores (HF's eager attention: cap * tanh(scores / cap) before the mask)."""
import random

import pytest
import torch
import torch.nn.functional as F

from pagedserve.attention.metadata import AttentionMetadata
from pagedserve.attention.reference import paged_attention, static_paged_attention, write_kv


@pytest.mark.parametrize("window,softcap", [(0, 0.0), (1, 0.0), (3, 0.0), (8, 0.0), (0, 1.5), (3, 1.5)])
@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_reference_matches_dense_sdpa(block_size, window, softcap):
    torch.manual_seed(0)
    rng = random.Random(0)
    H, Hkv, D = 4, 2, 8
    num_blocks = 64
    kc = torch.zeros(num_blocks, block_size, Hkv, D)
    vc = torch.zeros_like(kc)
    free = list(range(num_blocks))
    rng.shuffle(free)  # scattered physical blocks
    # (context already cached, new tokens): decodes first, then prefill/extend chunks.
    shapes = [(9, 1), (0, 1), (0, 7), (5, 6)]
    full_k, full_v, q_all, tables, slots, qlens, slens = [], [], [], [], [], [], []
    for cached, new in shapes:
        L = cached + new
        k, v, q = torch.randn(L, Hkv, D), torch.randn(L, Hkv, D), torch.randn(new, H, D)
        nb = -(-L // block_size)
        table = [free.pop() for _ in range(nb)]
        seq_slots = [table[p // block_size] * block_size + p % block_size for p in range(L)]
        write_kv(k[:cached], v[:cached], kc, vc, torch.tensor(seq_slots[:cached], dtype=torch.long))
        full_k.append(k); full_v.append(v); q_all.append(q); tables.append(table)
        slots += seq_slots[cached:]; qlens.append(new); slens.append(L)
    new_k = torch.cat([k[c:] for k, (c, _) in zip(full_k, shapes)])
    new_v = torch.cat([v[c:] for v, (c, _) in zip(full_v, shapes)])
    write_kv(new_k, new_v, kc, vc, torch.tensor(slots, dtype=torch.long))
    width = max(len(t) for t in tables)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots), query_start_loc=torch.tensor([0] + list(torch.tensor(qlens).cumsum(0))),
        seq_lens=torch.tensor(slens), block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables]),
        num_decodes=2, max_query_len=max(qlens), max_seq_len=max(slens), block_size=block_size)
    out = paged_attention(torch.cat(q_all), kc, vc, meta, scale=D ** -0.5, window=window, softcap=softcap)
    static = static_paged_attention(torch.cat(q_all), kc, vc, meta, D ** -0.5, window=window, softcap=softcap)
    torch.testing.assert_close(static, out, rtol=1e-5, atol=1e-5)
    lo = 0
    for (cached, new), k, v, q in zip(shapes, full_k, full_v, q_all):
        L = cached + new
        k_pos, q_pos = torch.arange(L)[None, :], torch.arange(cached, L)[:, None]
        mask = k_pos <= q_pos
        if window:
            mask &= k_pos > q_pos - window
        qh, kh, vh = q.transpose(0, 1), k.repeat_interleave(2, 1).transpose(0, 1), v.repeat_interleave(2, 1).transpose(0, 1)
        if softcap:  # HF's eager_attention_forward of Gemma 2, written out
            scores = torch.tanh(qh @ kh.transpose(1, 2) * D ** -0.5 / softcap) * softcap
            ref = scores.masked_fill(~mask, float("-inf")).softmax(-1) @ vh
        else:
            ref = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask)
        torch.testing.assert_close(out[lo:lo + new], ref.transpose(0, 1), rtol=1e-5, atol=1e-5)
        lo += new
