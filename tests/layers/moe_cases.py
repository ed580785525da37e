"""Shared inputs of the MoE layer tests: random experts and hand-made routings that cover the
dispatch's corners (an expert chosen twice by one token, experts with no token, one token, pairs
dropped with id E as expert parallelism does)."""
from __future__ import annotations

import torch


def experts(E: int, H: int, I: int, dtype=torch.float32, device="cpu", seed: int = 0):
    """Drawn on `device` (Mixtral's experts are 940M values: too slow to draw on the host)."""
    g = torch.Generator(device=device).manual_seed(seed)
    w13 = torch.randn(E, 2 * I, H, generator=g, device=device).mul_(H ** -0.5).to(dtype)
    w2 = torch.randn(E, H, I, generator=g, device=device).mul_(I ** -0.5).to(dtype)
    return w13, w2


def tokens(T: int, H: int, dtype=torch.float32, device="cpu", seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(T, H, generator=g).to(device=device, dtype=dtype)


def routings(T: int, E: int, top_k: int, seed: int = 2) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """name -> (weights [T', top_k] float32, ids [T', top_k] int32)."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    logits = torch.randn(T, E, generator=g)
    w, ids = torch.topk(torch.softmax(logits, -1), top_k, dim=-1)
    out["topk"] = (w, ids.to(torch.int32))
    # Every pair to expert 1 or 2 (a token sending both slots to one expert); the rest get nothing.
    dup = torch.ones(T, top_k, dtype=torch.int32)
    dup[::2] = 2
    out["duplicates_and_idle_experts"] = (torch.rand(T, top_k, generator=g), dup)
    out["one_token"] = (w[:1], ids[:1].to(torch.int32))
    last = torch.full((T, top_k), E - 1, dtype=torch.int32)  # only the last expert works
    out["last_expert_only"] = (torch.rand(T, top_k, generator=g), last)
    dropped = ids.to(torch.int32).clone()  # expert parallelism: pairs of other ranks' experts carry id E
    dropped[dropped % 2 == 1] = E
    dropped[0] = E  # a token with every pair dropped
    out["dropped_pairs"] = (w, dropped)
    return out


def fp8_experts(w13: torch.Tensor, w2: torch.Tensor):
    """(w13 fp8, w2 fp8, w13_scale [E, 2I], w2_scale [E, H]): each expert quantized per output
    channel, as FusedMoE's load-time FP8 does."""
    from pagedserve.layers.quant.fp8_ops import quantize_per_channel
    out = []
    for w in (w13, w2):
        pairs = [quantize_per_channel(w[e]) for e in range(w.shape[0])]
        out.append((torch.stack([q for q, _ in pairs]), torch.stack([s for _, s in pairs])))
    (q13, s13), (q2, s2) = out
    return q13, q2, s13, s2
