"""Batched token sampling: penalties, temperature, top-k / top-p / min-p, seeds, logprobs.

Everything runs on the logits' device as whole-batch tensor ops; the only Python loop is
over seeded rows (one noise draw each from the row's own generator), never over the vocab.

Sampling uses the exponential race: argmax(p / E) with E ~ Exp(1) i.i.d. picks token i with
probability p_i. A seeded row draws its E from its own generator, exactly vocab-size numbers per
step, so its tokens depend only on its seed and its logits, not on what else is in the batch.

Logprobs (the chosen token's, the top-N, and the cumulative sum) come from the model's *raw*
distribution, log_softmax of the unprocessed logits (vLLM's default "raw_logprobs"), so they
are comparable across sampling settings and equal to HF's log_softmax of the same logits.
The chosen token's is computed as logit - logsumexp (no vocab-sized output); the full
log_softmax is only formed when some row asks for top-N logprobs.

sample_plain is the fast path for a batch whose rows need nothing but a temperature: a few
batched ops and one device-to-host copy. It draws exactly what sample() draws for such rows.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from pagedserve.sampling_params import SamplingParams

_MASK = float("-inf")


def derive_seed(seed: int, index: int) -> int:
    """Seed of the index-th sample of a seeded request (index 0 is the seed itself).

    n > 1 / best_of forks draw their first token with these seeds, so sample i of a request
    equals a single-sample request with seed derive_seed(seed, i).
    """
    if index == 0:
        return seed
    # splitmix64 finaliser: well-mixed, deterministic, and cheap.
    z = (seed + 0x9E3779B97F4A7C15 * index) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return (z ^ (z >> 31)) & 0x7FFFFFFFFFFFFFFF


@dataclass(slots=True)
class SampleRow:
    """One token to draw. Several rows may read the same logits row (a fork's first samples)."""
    logits_index: int
    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    generator: torch.Generator | None = None       # None: the sampler's shared generator
    suppress_token_ids: list[int] = field(default_factory=list)  # set to -inf (min_tokens)


@dataclass
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[float]                           # raw logprob of each chosen token
    top_logprobs: list[dict[int, float] | None]     # top-N raw logprobs + the chosen one, if asked


def needs_only_temperature(p: SamplingParams) -> bool:
    """Whether sample_plain can draw for these params (given no seed generator and no suppression)."""
    return (p.seed is None and p.logprobs is None and p.top_k <= 0 and p.top_p >= 1.0 and p.min_p <= 0.0
            and p.repetition_penalty == 1.0 and not p.frequency_penalty and not p.presence_penalty)


def _chosen_logprobs(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """log_softmax(logits)[i, tokens[i]] without forming the whole log_softmax."""
    return logits.gather(1, tokens[:, None]).squeeze(1) - logits.logsumexp(dim=-1)


def _to_host(tokens: torch.Tensor, chosen: torch.Tensor) -> tuple[list[int], list[float]]:
    """Both lists in one device-to-host copy (float64 holds every token id exactly)."""
    host = torch.stack((tokens.double(), chosen.double()), dim=1).cpu()
    return host[:, 0].long().tolist(), host[:, 1].tolist()


def apply_penalties(logits: torch.Tensor, rows: list[SampleRow]) -> torch.Tensor:
    """Repetition (HF: over prompt + output), then frequency and presence (OpenAI: over output)."""
    n, vocab = logits.shape
    dev = logits.device
    rep = torch.tensor([r.params.repetition_penalty for r in rows], device=dev, dtype=logits.dtype)
    freq = torch.tensor([r.params.frequency_penalty for r in rows], device=dev, dtype=logits.dtype)
    pres = torch.tensor([r.params.presence_penalty for r in rows], device=dev, dtype=logits.dtype)

    def padded(seqs: list[list[int]]) -> torch.Tensor:
        # Pad with `vocab`, an extra column that is dropped after the scatter.
        width = max(1, max(len(s) for s in seqs))
        out = torch.full((n, width), vocab, dtype=torch.long)
        for i, s in enumerate(seqs):
            if s:
                out[i, :len(s)] = torch.tensor(s, dtype=torch.long)
        return out.to(dev)

    if (rep != 1.0).any():
        ids = padded([r.prompt_token_ids + r.output_token_ids for r in rows])
        seen = torch.zeros((n, vocab + 1), dtype=torch.bool, device=dev).scatter_(1, ids, True)[:, :vocab]
        penalised = torch.where(logits > 0, logits / rep[:, None], logits * rep[:, None])
        logits = torch.where(seen, penalised, logits)
    if (freq != 0).any() or (pres != 0).any():
        ids = padded([r.output_token_ids for r in rows])
        counts = torch.zeros((n, vocab + 1), dtype=logits.dtype, device=dev)
        counts.scatter_add_(1, ids, torch.ones_like(ids, dtype=logits.dtype))
        counts = counts[:, :vocab]
        logits = logits - freq[:, None] * counts - pres[:, None] * (counts > 0).to(logits.dtype)
    return logits


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Mask to -inf what top-k (k >= vocab: off) and then top-p (p >= 1: off) exclude.

    top-p keeps the smallest prefix of tokens, by descending probability, whose mass reaches p
    (at least one token): token t is dropped when the mass strictly before it is already >= p.
    """
    vocab = logits.shape[-1]
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    ranks = torch.arange(vocab, device=logits.device)
    sorted_logits = sorted_logits.masked_fill(ranks[None, :] >= top_k[:, None], _MASK)
    probs = sorted_logits.softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs
    drop = (mass_before >= top_p[:, None]) & (top_p[:, None] < 1.0)
    drop[:, 0] = False
    sorted_logits = sorted_logits.masked_fill(drop, _MASK)
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Drop tokens whose probability is below min_p times the most likely token's."""
    probs = logits.softmax(dim=-1)
    threshold = min_p[:, None] * probs.max(dim=-1, keepdim=True).values
    return logits.masked_fill(probs < threshold, _MASK)


class Sampler:
    def __init__(self, generator: torch.Generator):
        self.generator = generator  # shared by unseeded rows

    def process_logits(self, logits: torch.Tensor, rows: list[SampleRow]) -> torch.Tensor:
        """The logits the draw is made from: penalties, suppression, temperature, filters."""
        dev = logits.device
        params = [r.params for r in rows]
        if any(p.repetition_penalty != 1.0 or p.frequency_penalty or p.presence_penalty for p in params):
            logits = apply_penalties(logits, rows)
        suppress = [(i, t) for i, r in enumerate(rows) for t in r.suppress_token_ids]
        if suppress:
            ri, ti = zip(*suppress)
            logits = logits.clone()
            logits[torch.tensor(ri, device=dev), torch.tensor(ti, device=dev)] = _MASK
        if all(p.greedy for p in params):
            return logits
        temps = torch.tensor([p.temperature if p.temperature > 0 else 1.0 for p in params],
                             device=dev, dtype=logits.dtype)
        logits = logits / temps[:, None]
        vocab = logits.shape[-1]
        if any(p.top_k > 0 or p.top_p < 1.0 for p in params):
            top_k = torch.tensor([p.top_k if p.top_k > 0 else vocab for p in params], device=dev)
            top_p = torch.tensor([p.top_p for p in params], device=dev, dtype=logits.dtype)
            logits = apply_top_k_top_p(logits, top_k, top_p)
        if any(p.min_p > 0 for p in params):
            min_p = torch.tensor([p.min_p for p in params], device=dev, dtype=logits.dtype)
            logits = apply_min_p(logits, min_p)
        return logits

    def _draw(self, probs: torch.Tensor) -> torch.Tensor:
        """Exponential-race noise for unseeded rows, from the shared generator."""
        return torch.empty_like(probs).exponential_(generator=self.generator)

    def sample_plain(self, logits: torch.Tensor, temperatures: list[float]) -> SamplerOutput:
        """Row i of logits, drawn at temperatures[i] (0: greedy) with the shared generator; rows
        must satisfy needs_only_temperature and be all greedy or all temperature > 0."""
        n = len(temperatures)
        if logits.shape[0] != n:
            raise ValueError(f"sample_plain needs one logits row per temperature: {logits.shape[0]} != {n}")
        logits = logits.float()
        t0 = temperatures[0]
        if t0 == 0.0:
            if any(temperatures):
                raise ValueError("sample_plain rows must be all greedy or all temperature > 0")
            tokens = logits.argmax(dim=-1)
        else:
            if not all(temperatures):
                raise ValueError("sample_plain rows must be all greedy or all temperature > 0")
            if all(t == t0 for t in temperatures):
                temps = torch.full((n, 1), t0, device=logits.device, dtype=logits.dtype)
            else:
                temps = torch.tensor(temperatures, device=logits.device, dtype=logits.dtype)[:, None]
            probs = (logits / temps).softmax(dim=-1)
            noise = self._draw(probs).clamp_min_(torch.finfo(probs.dtype).tiny)
            tokens = (probs / noise).argmax(dim=-1)
        token_list, chosen_list = _to_host(tokens, _chosen_logprobs(logits, tokens))
        return SamplerOutput(token_list, chosen_list, [None] * n)

    def sample(self, logits: torch.Tensor, rows: list[SampleRow]) -> SamplerOutput:
        if not rows:
            return SamplerOutput([], [], [])
        dev = logits.device
        index = [r.logits_index for r in rows]
        if index != list(range(logits.shape[0])):
            logits = logits.index_select(0, torch.tensor(index, device=dev))
        logits = logits.float()
        x = self.process_logits(logits, rows)

        # Greedy rows: the top token survives every filter, so argmax of x is the greedy choice.
        sampled = [i for i, r in enumerate(rows) if not r.params.greedy]
        tokens = x.argmax(dim=-1) if len(sampled) < len(rows) else None
        if sampled:
            probs = x[sampled].softmax(dim=-1)
            noise = torch.empty_like(probs)
            shared = [j for j, i in enumerate(sampled) if rows[i].generator is None]
            for j, i in enumerate(sampled):
                if rows[i].generator is not None:
                    noise[j].exponential_(generator=rows[i].generator)
            if shared:
                draw = self._draw(probs.new_empty((len(shared), probs.shape[1])))
                if len(shared) == len(sampled):
                    noise = draw
                else:
                    noise[torch.tensor(shared, device=dev)] = draw
            noise.clamp_min_(torch.finfo(noise.dtype).tiny)
            if len(sampled) == len(rows):
                tokens = (probs / noise).argmax(dim=-1)
            else:
                tokens[torch.tensor(sampled, device=dev)] = (probs / noise).argmax(dim=-1)

        want = [r.params.logprobs for r in rows]
        max_n = max((w for w in want if w is not None), default=None)
        # One device->host transfer per step (float64 holds every token id exactly).
        chosen = _chosen_logprobs(logits, tokens)
        parts = [tokens.double()[:, None], chosen.double()[:, None]]
        if max_n:
            top_vals, top_ids = torch.log_softmax(logits, dim=-1).topk(max_n, dim=-1)
            parts += [top_ids.double(), top_vals.double()]
        host = torch.cat(parts, dim=1).cpu()
        token_list = host[:, 0].long().tolist()
        chosen_list = host[:, 1].tolist()
        if max_n:
            top_ids = host[:, 2:2 + max_n].long().tolist()
            top_vals = host[:, 2 + max_n:].tolist()

        tops: list[dict[int, float] | None] = []
        for i, w in enumerate(want):
            if w is None:
                tops.append(None)
                continue
            d = {} if not w else dict(zip(top_ids[i][:w], top_vals[i][:w]))
            d[token_list[i]] = chosen_list[i]
            tops.append(d)
        return SamplerOutput(token_list, chosen_list, tops)
