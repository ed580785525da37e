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
others share one generator; greedy rows draw nothing. Everything stays on the device until one copy
of the results (the host uploads the drafts without a sync).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedserve.layers.sampler import to_device


@dataclass
class VerifyRow:
    draft_token_ids: list[int]          # k >= 0 proposed ids
    greedy: bool
    generator: torch.Generator | None   # None: the sampler's shared generator


@dataclass
class VerifyResult:
    token_ids: list[list[int]]   # per row: the accepted drafts then one more token (1..k+1 ids)
    num_accepted: list[int]      # per row: accepted drafts (0..k)
    # Per row, with rejection_sample(logits=...): log_softmax(logits) of each emitted token at its position.
    logprobs: list[list[float]] | None = None


def _exp_noise(shape, device, generator: torch.Generator | None) -> torch.Tensor:
    return torch.empty(shape, device=device).exponential_(generator=generator).clamp_min_(
        torch.finfo(torch.float32).tiny)


def to_host(packed: torch.Tensor) -> list:
    """The verification's one device-to-host read (tests count the calls)."""
    return packed.tolist()


def rejection_sample(target_probs: torch.Tensor, rows: list[VerifyRow], draft_probs: torch.Tensor | None,
                     shared: torch.Generator, logits: torch.Tensor | None = None) -> VerifyResult:
    """target_probs: [sum(k_i + 1), V] float32, row i's k_i + 1 positions together in row order
    (for greedy rows any tensor whose argmax is the target's, e.g. the logits). draft_probs:
    [sum(k_i), V], the distributions the drafts were drawn from, in the same order; None: one-hot.
    logits: the raw logits of the same positions, for the emitted tokens' logprobs (optional).

    Everything is decided on the device, for all rows at once: acceptance as one compare per draft,
    the accepted run per row as a prefix product, the final token; then one copy to the host. The
    host only uploads what it knows (drafts, k, greedy), without a sync."""
    dev = target_probs.device
    n = len(rows)
    ks = [len(r.draft_token_ids) for r in rows]
    total, kmax = sum(ks), max(ks, default=0)
    greedy_h = [r.greedy for r in rows]
    all_greedy, sampled = all(greedy_h), [i for i, g in enumerate(greedy_h) if not g]
    host = to_device([d for r in rows for d in r.draft_token_ids] + ks + greedy_h, torch.long, dev)
    drafts, k_t, greedy = host[:total], host[total:total + n], host[total + n:].bool()
    starts = torch.cumsum(k_t + 1, 0) - (k_t + 1)        # first target row of each request
    flat_starts = torch.cumsum(k_t, 0) - k_t              # first draft of each request
    req = torch.repeat_interleave(torch.arange(n, device=dev), k_t, output_size=total)  # request of each draft
    j = torch.arange(total, device=dev) - flat_starts[req]                               # its index in the request
    t_rows = starts[req] + j                                                              # its target row

    if all_greedy:
        accept = drafts == target_probs[t_rows].argmax(dim=-1)
    else:
        u = _uniforms(rows, ks, total, dev, shared)
        p_d = target_probs[t_rows, drafts]
        q_d = torch.ones_like(p_d) if draft_probs is None else draft_probs[torch.arange(total, device=dev), drafts].float()
        accept = u * q_d <= p_d  # u < p/q without dividing by a zero q
        if any(greedy_h):
            accept = torch.where(greedy[req], drafts == target_probs[t_rows].argmax(dim=-1), accept)

    # Leading accepts per request: a prefix product over each request's row of drafts (padded with rejects).
    grid = torch.zeros(n, kmax, dtype=torch.long, device=dev)
    grid[req, j] = accept.long()
    num_accepted = grid.cumprod(dim=1).sum(dim=1) if kmax else torch.zeros(n, dtype=torch.long, device=dev)

    # The final token: from p at the bonus position, or from norm(max(0, p - q)) at the first rejection.
    final_rows = starts + num_accepted
    probs = target_probs[final_rows].float()
    if all_greedy:
        final = probs.argmax(dim=-1)
    else:
        final = _draw_final(probs, rows, sampled, drafts, draft_probs, flat_starts + num_accepted,
                            num_accepted < k_t, greedy, total, shared)
    packed = [num_accepted, final]
    if logits is not None:  # each position's candidate: its draft, or the final token where it lands
        cand = torch.zeros(logits.shape[0], dtype=torch.long, device=dev)
        cand[t_rows] = drafts
        cand[final_rows] = final
        lp = logits.gather(1, cand[:, None]).squeeze(1) - torch.logsumexp(logits, dim=-1)
        packed.append(lp)
    flat = to_host(torch.cat([t.double() for t in packed]))  # float64: ids and counts stay exact
    acc = [int(a) for a in flat[:n]]
    out = [list(r.draft_token_ids[:a]) + [int(f)] for r, a, f in zip(rows, acc, flat[n:2 * n])]
    lps = None
    if logits is not None:
        lp_all, lps, s = flat[2 * n:], [], 0
        for k, a in zip(ks, acc):
            lps.append(lp_all[s:s + a + 1])
            s += k + 1
    return VerifyResult(out, acc, lps)


def _uniforms(rows: list[VerifyRow], ks: list[int], total: int, dev, shared: torch.Generator) -> torch.Tensor:
    """One uniform per draft of a sampled row (greedy rows' stay unused): seeded rows from their own
    generator, in row order, after the others' from the shared one."""
    u = torch.zeros(total, device=dev)
    idx, offset = [], 0
    for r, k in zip(rows, ks):
        if r.generator is None and not r.greedy:
            idx.extend(range(offset, offset + k))
        offset += k
    if idx:
        u[to_device(idx, torch.long, dev)] = torch.rand(len(idx), device=dev, generator=shared)
    offset = 0
    for r, k in zip(rows, ks):
        if r.generator is not None and k and not r.greedy:
            u[offset:offset + k] = torch.rand(k, device=dev, generator=r.generator)
        offset += k
    return u


def _draw_final(probs: torch.Tensor, rows: list[VerifyRow], sampled: list[int], drafts: torch.Tensor,
                draft_probs: torch.Tensor | None, pos: torch.Tensor, rejected: torch.Tensor,
                greedy: torch.Tensor, total: int, shared: torch.Generator) -> torch.Tensor:
    """Each row's last token from probs ([n, V]: p at its final position): greedy rows the argmax;
    sampled rows a draw from p, or where a draft was rejected (pos: that draft's flat index) from
    norm(max(0, p - q)), by exponential race with their own noise."""
    dev = probs.device
    if total:
        pos = pos.clamp(max=total - 1)  # rows that accepted everything: any index, masked below
        if draft_probs is None:
            q = torch.zeros_like(probs).scatter_(1, drafts[pos][:, None], 1.0)
        else:
            q = draft_probs[pos].float()
        resid = (probs - q).clamp_min_(0)
        mass = resid.sum(dim=-1, keepdim=True)
        # Mass 0 happens only where p <= q everywhere, i.e. p == q, and then nothing is rejected;
        # float round-off can still get here: fall back to p.
        resid = torch.where(mass > 0, resid / mass.clamp_min(1e-30), probs)
        dist = torch.where((rejected & ~greedy)[:, None], resid, probs)
    else:
        dist = probs
    noise = torch.ones_like(probs)
    shared_rows = [i for i in sampled if rows[i].generator is None]
    if shared_rows:
        noise[to_device(shared_rows, torch.long, dev)] = _exp_noise((len(shared_rows), probs.shape[1]), dev, shared)
    for i in sampled:
        if rows[i].generator is not None:
            noise[i] = _exp_noise((probs.shape[1],), dev, rows[i].generator)
    return torch.where(greedy, probs.argmax(dim=-1), (dist / noise).argmax(dim=-1))
