"""Random paged batches for kernel tests: scattered blocks, decodes first, then prefill/extend chunks."""
from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from pagedserve.attention import reference
from pagedserve.attention.metadata import AttentionMetadata


@dataclass
class PagedBatch:
    query: torch.Tensor        # [num_tokens, H, D]
    new_k: torch.Tensor        # [num_tokens, Hkv, D]: this step's K/V, not yet in the pools
    new_v: torch.Tensor
    k_cache: torch.Tensor      # pools holding every sequence's cached prefix
    v_cache: torch.Tensor
    meta: AttentionMetadata


def make_batch(shapes: list[tuple[int, int]], num_decodes: int, H: int, Hkv: int, D: int, block_size: int,
               dtype=torch.float32, device="cpu", seed: int = 0, spare_blocks: int = 3,
               in_runs: bool = False) -> PagedBatch:
    """shapes: (cached tokens, new tokens) per sequence; the first num_decodes must have 1 new token.
    in_runs: each sequence's blocks one run of ascending ids (as a fresh pool hands them out)."""
    assert all(new == 1 for _, new in shapes[:num_decodes])
    gen = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    need = sum(-(-(c + n) // block_size) for c, n in shapes)
    num_blocks = need + spare_blocks
    free = list(range(num_blocks))
    if in_runs:
        free.reverse()  # popped from the end: ascending ids
    else:
        rng.shuffle(free)
    kc = torch.randn(num_blocks, block_size, Hkv, D, generator=gen).to(dtype)  # garbage outside live slots
    vc = torch.randn(num_blocks, block_size, Hkv, D, generator=gen).to(dtype)
    tables, slots, qlens, slens, queries, new_ks, new_vs = [], [], [], [], [], [], []
    for cached, new in shapes:
        L = cached + new
        k = torch.randn(L, Hkv, D, generator=gen).to(dtype)
        v = torch.randn(L, Hkv, D, generator=gen).to(dtype)
        queries.append(torch.randn(new, H, D, generator=gen).to(dtype))
        table = [free.pop() for _ in range(-(-L // block_size))]
        seq_slots = [table[p // block_size] * block_size + p % block_size for p in range(L)]
        reference.write_kv(k[:cached], v[:cached], kc, vc, torch.tensor(seq_slots[:cached], dtype=torch.long))
        new_ks.append(k[cached:]); new_vs.append(v[cached:])
        tables.append(table); slots += seq_slots[cached:]; qlens.append(new); slens.append(L)
    width = max(len(t) for t in tables)
    qsl = [0]
    for q in qlens:
        qsl.append(qsl[-1] + q)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.long, device=device),
        query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(slens, dtype=torch.int32, device=device),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32, device=device),
        num_decodes=num_decodes, max_query_len=max(qlens), max_seq_len=max(slens), block_size=block_size,
        query_lens_cpu=qlens, seq_lens_cpu=slens)
    return PagedBatch(torch.cat(queries).to(device), torch.cat(new_ks).to(device), torch.cat(new_vs).to(device),
                      kc.to(device), vc.to(device), meta)
