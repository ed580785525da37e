"""The rejection sampler: verify proposed tokens so the output follows the target exactly.

Leviathan et al. (2023), per request with k proposed tokens d_1..d_k drawn from q, and the
target's distributions p_1..p_{k+1} at the k + 1 verified positions:
  - d_j is accepted with probability min(1, p_j(d_j) / q_j(d_j)), in order, until one is not;
  - at the first rejection j, one token is drawn from norm(max(0, p_j - q_j)) and the rest is dropped;
  - when all k pass, a bonus token is drawn from p_{k+1}.
Each emitted token then has exactly the target's distribution. A deterministic proposer
(draft_probs None) has a one-hot q: accept with probability p_j(d_j), resample from p_j with
d_j removed. Greedy rows (temperature 0) accept while d_j equals the target's argmax and emit the
argmax at the first mismatch (or the bonus argmax): exactly the tokens plain greedy decoding gives.

Randomness: a row with its own generator (a seeded request) draws its uniforms and its final
token's noise from it alone, in a fixed order, so its output does not depend on the batch; the
others share one generator. Everything stays on the device until one copy of the results.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class VerifyRow:
    draft_token_ids: list[int]          # k >= 0 proposed ids
    greedy: bool
    generator: torch.Generator | None   # None: the sampler's shared generator


@dataclass
class VerifyResult:
    token_ids: list[list[int]]   # per row: the accepted drafts then one more token (1..k+1 ids)
    num_accepted: list[int]      # per row: accepted drafts (0..k)


def _exp_noise(shape, device, generator: torch.Generator | None) -> torch.Tensor:
    return torch.empty(shape, device=device).exponential_(generator=generator).clamp_min_(
        torch.finfo(torch.float32).tiny)


def rejection_sample(target_probs: torch.Tensor, rows: list[VerifyRow], draft_probs: torch.Tensor | None,
                     shared: torch.Generator) -> VerifyResult:
    """target_probs: [sum(k_i + 1), V] float32, row i's k_i + 1 positions together in row order
    (for greedy rows any tensor whose argmax is the target's, e.g. the logits). draft_probs:
    [sum(k_i), V], the distributions the drafts were drawn from, in the same order; None: one-hot."""
    dev = target_probs.device
    ks = [len(r.draft_token_ids) for r in rows]
    n, total = len(rows), sum(ks)
    k_t = torch.tensor(ks, dtype=torch.long)
    starts = torch.cumsum(k_t + 1, 0) - (k_t + 1)          # first target row of each request
    # Flat draft positions: request of each, its index j, its target row.
    req = torch.repeat_interleave(torch.arange(n), k_t)
    j = torch.arange(total) - torch.repeat_interleave(torch.cumsum(k_t, 0) - k_t, k_t)
    t_rows = (starts[req] + j).to(dev)
    drafts = torch.tensor([d for r in rows for d in r.draft_token_ids], dtype=torch.long).to(dev)
    greedy = torch.tensor([r.greedy for r in rows], dtype=torch.bool)

    # Uniforms, one per draft: seeded rows from their own generator, the rest from the shared one.
    u = torch.empty(total, device=dev)
    if total:
        shared_mask = torch.tensor([r.generator is None for r in rows])[req]
        if bool(shared_mask.any()):
            idx = shared_mask.nonzero().squeeze(1).to(dev)
            u[idx] = torch.rand(int(idx.numel()), device=dev, generator=shared)
        offset = 0
        for r, k in zip(rows, ks):
            if r.generator is not None and k:
                u[offset:offset + k] = torch.rand(k, device=dev, generator=r.generator)
            offset += k

    p_d = target_probs[t_rows, drafts] if total else u
    if draft_probs is None:
        q_d = torch.ones_like(p_d)
    else:
        q_d = draft_probs[torch.arange(total, device=dev), drafts].float()
    accept = u * q_d <= p_d  # u < p/q without dividing by a zero q
    greedy_d = greedy[req].to(dev)
    if bool(greedy.any()) and total:
        argmax_d = target_probs[t_rows].argmax(dim=-1)
        accept = torch.where(greedy_d, drafts == argmax_d, accept)

    # Leading accepts per request: a prefix product over each request's own run of drafts.
    acc_host = accept.cpu().tolist()
    num_accepted, offset = [], 0
    for k in ks:
        a = 0
        while a < k and acc_host[offset + a]:
            a += 1
        num_accepted.append(a)
        offset += k

    # The final token: from p at the bonus position, or from norm(max(0, p - q)) at the first rejection.
    final_rows = torch.tensor([int(s) + a for s, a in zip(starts.tolist(), num_accepted)], dtype=torch.long).to(dev)
    probs = target_probs[final_rows].float()
    rejected = [a < k for a, k in zip(num_accepted, ks)]
    if any(rejected):
        flat_starts = torch.cumsum(k_t, 0) - k_t
        rj = [i for i, x in enumerate(rejected) if x]
        pos = [int(flat_starts[i]) + num_accepted[i] for i in rj]
        rj_t = torch.tensor(rj, dtype=torch.long, device=dev)
        pos_t = torch.tensor(pos, dtype=torch.long, device=dev)
        p = probs[rj_t]
        if draft_probs is None:
            q = torch.zeros_like(p)
            q[torch.arange(len(rj), device=dev), drafts[pos_t]] = 1.0
        else:
            q = draft_probs[pos_t].float()
        resid = (p - q).clamp_min_(0)
        mass = resid.sum(dim=-1, keepdim=True)
        # Mass 0 happens only where p <= q everywhere, i.e. p == q, and then nothing is rejected;
        # float round-off can still get here: fall back to p.
        resid = torch.where(mass > 0, resid / mass.clamp_min(1e-30), p)
        greedy_rj = greedy[rj_t.cpu()].to(dev)
        probs[rj_t] = torch.where(greedy_rj[:, None], probs[rj_t], resid)
    V = probs.shape[1]
    noise = torch.empty_like(probs)
    sh = [i for i, r in enumerate(rows) if r.generator is None]
    if sh:
        noise[torch.tensor(sh, device=dev)] = _exp_noise((len(sh), V), dev, shared)
    for i, r in enumerate(rows):
        if r.generator is not None:
            noise[i] = _exp_noise((V,), dev, r.generator)
    sampled = probs / noise
    final = torch.where(greedy.to(dev), probs.argmax(dim=-1), sampled.argmax(dim=-1)).tolist()

    out, offset = [], 0
    for r, k, a, f in zip(rows, ks, num_accepted, final):
        out.append(list(r.draft_token_ids[:a]) + [int(f)])
    return VerifyResult(out, num_accepted)
