"""Batched token sampling: penalties, logit bias, allowed tokens, temperature, top-k / top-p /
min-p, seeds, logprobs.

Everything runs on the logits' device as whole-batch tensor ops; the only Python loop is
over seeded rows (one noise draw each from the row's own generator), never over the vocab.

Sampling uses the exponential race: argmax(p / E) with E ~ Exp(1) i.i.d. picks token i with
probability p_i. A seeded row draws its E from its own generator, exactly vocab-size numbers per
step, so its tokens depend only on its seed and its logits, not on what else is in the batch.

Logprobs (the chosen token's, the top-N, and the cumulative sum) come from the model's *raw*
distribution, log_softmax of the unprocessed logits (vLLM's default "raw_logprobs"), so they
are comparable across sampling settings and equal to HF's log_softmax of the same logits.
The chosen token's is computed as logit - logsumexp (no vocab-sized output); the full
log_softmax is only formed when some row asks for top-N logprobs. A row that asks for logprobs
also gets its chosen token's rank (token_ranks: vLLM's count of tokens at least as likely),
counted over that row only. Such a row's result is a PositionLogprobs (pagedserve/logprobs.py):
plain numbers, made into vLLM's Logprob objects by the front end.

sample_plain is the fast path for a batch whose rows need nothing but a temperature: a few
batched ops and one device-to-host copy. In torch (CPU, or PAGEDSERVE_FUSED_SAMPLING=0) it draws
exactly what sample() draws for such rows. On CUDA it is one pass of Triton kernels over the
logits (triton_sampling.py): greedy rows get exactly torch's argmax; temperature rows draw from the
same distribution with Philox noise keyed by a per-step seed instead of the shared generator's.
Logits arrive in the model's dtype; every torch path converts them to float32 first.

Every draw has a device half (sample_device / sample_plain_device: a DeviceSample, tensors only,
no host sync unless a row needs penalties) and a host half (DeviceSample.packed() -> one
device-to-host copy -> SamplerOutput.from_packed), so overlapped steps can feed the sampled ids
to the next step on the device and copy them out on a side stream. Per-row parameters reach the
device through pinned, non-blocking copies. top-k / top-p never sort the vocab: torch.topk of the
largest k in the batch, top-p inside those k; rows with top-p but no top-k bisect a probability
threshold instead.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from pagedserve.layers.fused import fused_sampling
from pagedserve.logprobs import PositionLogprobs
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
    # Per row that asked for logprobs (SamplingParams.logprobs = N): the chosen token, its rank
    # and the top N, as plain numbers; None for the others.
    position_logprobs: list[PositionLogprobs | None]

    @classmethod
    def from_packed(cls, host: torch.Tensor, want: list[int | None]) -> "SamplerOutput":
        """From DeviceSample.packed() copied to the host: columns token, logprob, then (when a row
        asked for logprobs) rank, then (when one asked for N > 0) N top ids and N top values."""
        token_list = host[:, 0].long().tolist()
        chosen_list = host[:, 1].tolist()
        if all(w is None for w in want):
            return cls(token_list, chosen_list, [None] * len(want))
        ranks = host[:, 2].long().tolist()
        max_n = max(w for w in want if w is not None)
        if max_n:
            top_ids = host[:, 3:3 + max_n].long().tolist()
            top_vals = host[:, 3 + max_n:].tolist()
        positions: list[PositionLogprobs | None] = []
        for i, w in enumerate(want):
            if w is None:
                positions.append(None)
                continue
            tok, lp = token_list[i], chosen_list[i]
            ids = top_ids[i][:w] if w else []
            # The chosen token's own value wherever it appears: every Logprob of it then agrees
            # with what cumulative_logprob sums (log_softmax and logit - logsumexp may differ by an ulp).
            vals = [lp if t == tok else v for t, v in zip(ids, top_vals[i])] if w else []
            positions.append(PositionLogprobs([tok] + ids, [lp] + vals, ranks[i]))
        return cls(token_list, chosen_list, positions)


@dataclass
class DeviceSample:
    """One draw, still on the device: nothing here has been copied to the host."""
    tokens: torch.Tensor                  # [n] int64 sampled ids
    logprobs: torch.Tensor                # [n] raw logprob of each
    want: list[int | None]                # per row: how many top logprobs (None: not asked)
    ranks: torch.Tensor | None = None     # [n] chosen tokens' ranks (0 in rows that did not ask), if any asked
    top_ids: torch.Tensor | None = None   # [n, max_n]
    top_vals: torch.Tensor | None = None
    packed_ready: torch.Tensor | None = None  # packed() already built (the fused kernel writes it)

    def packed(self) -> torch.Tensor:
        """Everything the host needs as one float64 tensor (float64 holds every token id exactly)."""
        if self.packed_ready is not None:
            return self.packed_ready
        parts = [self.tokens.double()[:, None], self.logprobs.double()[:, None]]
        if self.ranks is not None:
            parts.append(self.ranks.double()[:, None])
        if self.top_ids is not None:
            parts += [self.top_ids.double(), self.top_vals.double()]
        return torch.cat(parts, dim=1)

    def to_host(self) -> SamplerOutput:
        """Synchronous: one device-to-host copy."""
        return SamplerOutput.from_packed(self.packed().cpu(), self.want)


def to_device(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A small host list on `device` without a host sync: pinned and copied non-blocking on CUDA
    (a plain torch.tensor(..., device=cuda) waits for the stream)."""
    t = torch.tensor(values, dtype=dtype)
    if device.type == "cpu":
        return t
    return t.pin_memory().to(device, non_blocking=True)


def needs_only_temperature(p: SamplingParams) -> bool:
    """Whether sample_plain can draw for these params (given no seed generator and no suppression)."""
    return (p.seed is None and p.logprobs is None and p.top_k <= 0 and p.top_p >= 1.0 and p.min_p <= 0.0
            and not penalised(p) and not p.logit_bias and p.allowed_token_ids is None and not p.bad_words_token_ids)


def _chosen_logprobs(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """log_softmax(logits)[i, tokens[i]] without forming the whole log_softmax."""
    return logits.gather(1, tokens[:, None]).squeeze(1) - logits.logsumexp(dim=-1)


def token_ranks(logits: torch.Tensor, tokens: torch.Tensor, rows: list[int] | None = None) -> torch.Tensor:
    """vLLM's rank of each row's token: how many tokens of the row have a logit >= its own (1: the
    most likely; tied tokens all count, vLLM's batched_count_greater_than). Counted on the raw
    logits, as vLLM's GPU model runner (the default since 0.25) counts; its older sampler counts
    on their log_softmax, the same order up to rounding. rows: count only these rows (the others
    get 0), so rows that asked for no logprobs cost nothing."""
    if rows is not None and len(rows) < logits.shape[0]:
        idx = to_device(rows, torch.long, logits.device)
        counts = _count_at_least(logits.index_select(0, idx), tokens.index_select(0, idx))
        return torch.zeros(logits.shape[0], dtype=counts.dtype, device=logits.device).index_copy_(0, idx, counts)
    return _count_at_least(logits, tokens)


def _count_at_least(x: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    return (x >= x.gather(1, tokens[:, None])).sum(dim=-1)


def penalised(p: SamplingParams) -> bool:
    """Whether a request's logits take repetition, frequency or presence penalties."""
    return p.repetition_penalty != 1.0 or bool(p.frequency_penalty) or bool(p.presence_penalty)


def apply_penalties(logits: torch.Tensor, rows: list[SampleRow],
                    pending: torch.Tensor | None = None) -> torch.Tensor:
    """Repetition (HF: over prompt + output), then frequency and presence (OpenAI: over output).

    pending: [n] per row, an output token still on the device (an overlapped step's, not yet in
    output_token_ids) or vocab for none; it counts as the output's last token. Nothing here reads
    the device: the switches come from the rows' params, the host lists go up pinned."""
    n, vocab = logits.shape
    dev = logits.device
    rep = to_device([r.params.repetition_penalty for r in rows], logits.dtype, dev)
    freq = to_device([r.params.frequency_penalty for r in rows], logits.dtype, dev)
    pres = to_device([r.params.presence_penalty for r in rows], logits.dtype, dev)

    def padded(seqs: list[list[int]]) -> torch.Tensor:
        # Pad with `vocab`, an extra column that is dropped after the scatter.
        width = max(1, max(len(s) for s in seqs))
        out = torch.full((n, width), vocab, dtype=torch.long)
        for i, s in enumerate(seqs):
            if s:
                out[i, :len(s)] = torch.tensor(s, dtype=torch.long)
        out = out if dev.type == "cpu" else out.pin_memory().to(dev, non_blocking=True)
        return out if pending is None else torch.cat([out, pending[:, None]], dim=1)

    if any(r.params.repetition_penalty != 1.0 for r in rows):
        ids = padded([r.prompt_token_ids + r.output_token_ids for r in rows])
        seen = torch.zeros((n, vocab + 1), dtype=torch.bool, device=dev).scatter_(1, ids, True)[:, :vocab]
        penalised = torch.where(logits > 0, logits / rep[:, None], logits * rep[:, None])
        logits = torch.where(seen, penalised, logits)
    if any(r.params.frequency_penalty or r.params.presence_penalty for r in rows):
        ids = padded([r.output_token_ids for r in rows])
        counts = torch.zeros((n, vocab + 1), dtype=logits.dtype, device=dev)
        counts.scatter_add_(1, ids, torch.ones_like(ids, dtype=logits.dtype))
        counts = counts[:, :vocab]
        logits = logits - freq[:, None] * counts - pres[:, None] * (counts > 0).to(logits.dtype)
    return logits


def apply_bias_and_allowed(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """logit_bias added (a sparse add over the rows that have one), then -inf outside each row's
    allowed_token_ids. A new tensor: the raw logits still give the logprobs."""
    dev = logits.device
    logits = logits.clone()
    bias = [(i, t, b) for i, p in enumerate(params) if p.logit_bias for t, b in p.logit_bias.items()]
    if bias:
        ri, ti, bv = zip(*bias)
        logits.index_put_((to_device(list(ri), torch.long, dev), to_device(list(ti), torch.long, dev)),
                          to_device(list(bv), logits.dtype, dev), accumulate=True)
    limited = [i for i, p in enumerate(params) if p.allowed_token_ids is not None]
    if limited:
        keep = torch.ones_like(logits, dtype=torch.bool)
        keep[to_device(limited, torch.long, dev)] = False
        pairs = [(i, t) for i in limited for t in params[i].allowed_token_ids]
        ri, ti = zip(*pairs)
        keep[to_device(list(ri), torch.long, dev), to_device(list(ti), torch.long, dev)] = True
        logits.masked_fill_(~keep, _MASK)
    return logits


_TOP_P_BISECTIONS = 32  # float32 probabilities: the threshold's interval is below one ulp by then


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                      k_limit: int | None = None, every_row_top_k: bool | None = None,
                      any_top_p: bool | None = None) -> torch.Tensor:
    """Mask to -inf what top-k (k >= vocab: off) and then top-p (p >= 1: off) exclude.

    top-p keeps the smallest prefix of tokens, by descending probability, whose mass reaches p
    (at least one token): token t is dropped when the mass strictly before it is already >= p.
    k_limit: the largest top_k below vocab among the rows (0: no row has one), every_row_top_k:
    whether every row has one, any_top_p: whether some row has top_p < 1; the device sampler
    passes them from the host so nothing here reads the device (None: read from the tensors).
    Without a full sort: when every row has a top-k, the top k_limit candidates
    (torch.topk, descending) hold every survivor, and top-p runs inside them; otherwise the k-th
    largest logit is each row's top-k threshold and top-p's threshold is found by bisection on
    the probability (keep p_t >= t for the largest t whose kept mass still reaches p).
    """
    vocab = logits.shape[-1]
    if k_limit is None or every_row_top_k is None:
        ks = top_k.tolist()
        k_limit = max((k for k in ks if k < vocab), default=0)
        every_row_top_k = all(k < vocab for k in ks)
    if any_top_p is None:
        any_top_p = bool((top_p < 1.0).any())
    if k_limit and every_row_top_k:
        vals, idx = logits.topk(k_limit, dim=-1)
        ranks = torch.arange(k_limit, device=logits.device)
        vals = vals.masked_fill(ranks[None, :] >= top_k[:, None], _MASK)
        if any_top_p:
            probs = vals.softmax(dim=-1)
            mass_before = probs.cumsum(dim=-1) - probs
            drop = (mass_before >= top_p[:, None]) & (top_p[:, None] < 1.0)
            drop[:, 0] = False
            vals = vals.masked_fill(drop, _MASK)
        return torch.full_like(logits, _MASK).scatter_(1, idx, vals)
    x = logits
    if k_limit:
        kth = x.topk(k_limit, dim=-1).values.gather(1, (top_k.clamp(max=k_limit) - 1)[:, None])
        x = x.masked_fill((top_k[:, None] < vocab) & (x < kth), _MASK)
    if any_top_p:
        probs = x.softmax(dim=-1)
        p = top_p[:, None].to(probs.dtype)
        lo = torch.zeros_like(p)
        hi = probs.max(dim=-1, keepdim=True).values
        for _ in range(_TOP_P_BISECTIONS):
            mid = (lo + hi) * 0.5
            reaches = (probs * (probs >= mid)).sum(dim=-1, keepdim=True) >= p
            lo = torch.where(reaches, mid, lo)
            hi = torch.where(reaches, hi, mid)
        x = x.masked_fill((probs < lo) & (p < 1.0), _MASK)
    return x


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Drop tokens whose probability is below min_p times the most likely token's."""
    probs = logits.softmax(dim=-1)
    threshold = min_p[:, None] * probs.max(dim=-1, keepdim=True).values
    return logits.masked_fill(probs < threshold, _MASK)


class Sampler:
    def __init__(self, generator: torch.Generator):
        self.generator = generator  # shared by unseeded rows
        self._fused_draws = 0  # steps the fused kernel has drawn for: each gets a seed of its own

    def _fused_seed(self) -> int:
        """The next Philox seed of the fused plain path, from the shared generator's seed and a
        host counter: reproducible for a seeded engine, and no device read."""
        self._fused_draws += 1
        return derive_seed(self.generator.initial_seed(), self._fused_draws) & 0x7FFFFFFF

    def process_logits(self, logits: torch.Tensor, rows: list[SampleRow],
                       pending: torch.Tensor | None = None) -> torch.Tensor:
        """The logits the draw is made from: penalties (pending: apply_penalties'), suppression,
        temperature, filters."""
        dev = logits.device
        params = [r.params for r in rows]
        if any(penalised(p) for p in params):
            logits = apply_penalties(logits, rows, pending)
        if any(p.logit_bias or p.allowed_token_ids is not None for p in params):
            logits = apply_bias_and_allowed(logits, params)
        suppress = [(i, t) for i, r in enumerate(rows) for t in r.suppress_token_ids]
        if suppress:
            ri, ti = zip(*suppress)
            logits = logits.clone()
            logits[to_device(list(ri), torch.long, dev), to_device(list(ti), torch.long, dev)] = _MASK
        if all(p.greedy for p in params):
            return logits
        temps = to_device([p.temperature if p.temperature > 0 else 1.0 for p in params], logits.dtype, dev)
        logits = logits / temps[:, None]
        vocab = logits.shape[-1]
        ks = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
        any_top_p = any(p.top_p < 1.0 for p in params)
        k_limit = max((k for k in ks if k < vocab), default=0)
        if k_limit or any_top_p:
            top_k = to_device(ks, torch.long, dev)
            top_p = to_device([p.top_p for p in params], logits.dtype, dev)
            logits = apply_top_k_top_p(logits, top_k, top_p, k_limit, all(k < vocab for k in ks), any_top_p)
        if any(p.min_p > 0 for p in params):
            min_p = to_device([p.min_p for p in params], logits.dtype, dev)
            logits = apply_min_p(logits, min_p)
        return logits

    def _draw(self, probs: torch.Tensor) -> torch.Tensor:
        """Exponential-race noise for unseeded rows, from the shared generator."""
        return torch.empty_like(probs).exponential_(generator=self.generator)

    def sample_plain_device(self, logits: torch.Tensor, temperatures: list[float]) -> DeviceSample:
        """Row i of logits, drawn at temperatures[i] (0: greedy) with the shared generator; rows
        must satisfy needs_only_temperature and be all greedy or all temperature > 0."""
        n = len(temperatures)
        if logits.shape[0] != n:
            raise ValueError(f"sample_plain needs one logits row per temperature: {logits.shape[0]} != {n}")
        t0 = temperatures[0]
        greedy = t0 == 0.0
        if (any(temperatures) if greedy else not all(temperatures)):
            raise ValueError("sample_plain rows must be all greedy or all temperature > 0")
        kernels = fused_sampling(logits.device)
        if kernels is not None and kernels.supports(logits):
            temps = None if greedy else to_device(temperatures, torch.float32, logits.device)
            tokens, packed = kernels.sample_rows(logits, temps, self._fused_seed())
            return DeviceSample(tokens, packed[:, 1], [None] * n, packed_ready=packed)
        logits = logits.float()
        if greedy:
            tokens = logits.argmax(dim=-1)
        else:
            if all(t == t0 for t in temperatures):
                probs = (logits / t0).softmax(dim=-1)
            else:
                probs = (logits / to_device(temperatures, logits.dtype, logits.device)[:, None]).softmax(dim=-1)
            noise = self._draw(probs).clamp_min_(torch.finfo(probs.dtype).tiny)
            tokens = (probs / noise).argmax(dim=-1)
        return DeviceSample(tokens, _chosen_logprobs(logits, tokens), [None] * n)

    def sample_plain(self, logits: torch.Tensor, temperatures: list[float]) -> SamplerOutput:
        return self.sample_plain_device(logits, temperatures).to_host()

    def sample_device(self, logits: torch.Tensor, rows: list[SampleRow],
                      pending: torch.Tensor | None = None) -> DeviceSample:
        """The draw for every row, left on the device; nothing here reads it. pending: each row's
        output token still on the device, for penalties (apply_penalties)."""
        dev = logits.device
        index = [r.logits_index for r in rows]
        if index != list(range(logits.shape[0])):
            logits = logits.index_select(0, to_device(index, torch.long, dev))
        logits = logits.float()
        x = self.process_logits(logits, rows, pending)

        # Greedy rows: the top token survives every filter, so argmax of x is the greedy choice.
        sampled = [i for i, r in enumerate(rows) if not r.params.greedy]
        tokens = x.argmax(dim=-1) if len(sampled) < len(rows) else None
        if sampled:
            probs = (x if len(sampled) == len(rows) else x[to_device(sampled, torch.long, dev)]).softmax(dim=-1)
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
                    noise[to_device(shared, torch.long, dev)] = draw
            noise.clamp_min_(torch.finfo(noise.dtype).tiny)
            if len(sampled) == len(rows):
                tokens = (probs / noise).argmax(dim=-1)
            else:
                tokens[to_device(sampled, torch.long, dev)] = (probs / noise).argmax(dim=-1)

        want = [r.params.logprobs for r in rows]
        max_n = max((w for w in want if w is not None), default=None)
        result = DeviceSample(tokens, _chosen_logprobs(logits, tokens), want)
        if max_n is not None:
            result.ranks = token_ranks(logits, tokens, [i for i, w in enumerate(want) if w is not None])
        if max_n:
            result.top_vals, result.top_ids = torch.log_softmax(logits, dim=-1).topk(max_n, dim=-1)
        return result

    def sample(self, logits: torch.Tensor, rows: list[SampleRow]) -> SamplerOutput:
        if not rows:
            return SamplerOutput([], [], [])
        return self.sample_device(logits, rows).to_host()
