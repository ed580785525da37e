"""Speculative decoding in the engine's step: propose before scheduling, verify after the forward.

One step with speculation, synchronous (see LLMEngine.step):
  1. the policy picks k from the running batch (spec_decode/policy.py); k = 0 leaves the step as
     it was, overlapped scheduling included;
  2. the proposer fills seq.spec_token_ids of every running single-sequence decode whose request
     can speculate (timed: proposer_seconds). A host-side proposer (spec_decode/proposer.py) is
     first asked over the host's histories while a step is in flight (peek); with nothing there,
     or nothing in its fresh proposals once no step is in flight, the step runs overlapped as if
     k were 0 (nothing_to_propose; counted in num_unproposed_steps);
  3. the scheduler grants each as many lookahead slots as fit (core/scheduler.py) and the runner
     runs the last token plus the granted proposals as one row, returning logits at all 1 + k
     positions (runner/batch.py sample_rows);
  4. here: the rejection sampler (spec_decode/rejection.py) turns each row's logits into its
     emitted tokens (accepted proposals, then one more), sets ScheduledSequence.num_rejected so
     the scheduler rolls the rejected slots back, and the engine appends the tokens one by one
     through the ordinary stop rules, so a stop token or string inside an accepted run ends the
     sequence exactly where decoding without speculation would;
  5. after the step (clear): the policy observes the step's yield, 1 + accepted proposals / rows
     that got proposals, and pauses speculation while it stays below what the step cost (a draft
     model's forwards count), or while the proposer keeps having nothing for any row
     (spec_decode/policy.py). A host-side proposer's probes after a pause are shadow probes
     (spec_decode/shadow.py): made over the host's histories and scored from the tokens decoding
     emits, while the steps stay overlapped.

Which requests speculate: single sequences (n = best_of = 1) whose tokens depend only on the
logits at each position: temperature, top-k, top-p, min-p, seeds and structured outputs; not
those with penalties, min_tokens, bad_words, logprobs, prompt_logprobs or beam search, which decode as
before beside speculating ones in the same batch.

Structured outputs: the grammar checks proposals before they are verified (a copy of the
sequence's matcher accepts them in order; the first refused one and everything after it is
dropped, and so is a token that would close the grammar), and each verified position's logits
are masked with the grammar's state after the proposals before it, so the rejection sampler
draws from the constrained target distribution exactly as decoding without speculation does.
"""
from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

from pagedserve.layers.sampler import SampleRow, penalised, to_device
from pagedserve.sampling_params import SamplingParams
from pagedserve.sequence import Sequence, SequenceGroup, SequenceStatus
from pagedserve.spec_decode.config import SpeculativeConfig
from pagedserve.spec_decode.factory import make_proposer
from pagedserve.spec_decode.policy import SpeculationPolicy
from pagedserve.spec_decode.proposer import ProposalRequest, TokenHistory, proposes_on_host
from pagedserve.spec_decode.rejection import VerifyRow, rejection_sample
from pagedserve.spec_decode.shadow import ShadowProbe
from pagedserve.spec_decode.stats import SpecDecodeStats

RUNNING = SequenceStatus.RUNNING
# A shadow probe's rows not scored within k + this many steps are dropped (spec_decode/shadow.py):
# the token in flight when it was taken, the step that proposes, and one step of slack.
SHADOW_SLACK_STEPS = 3


def can_speculate(p: SamplingParams) -> bool:
    """Whether a request's sampling lets it verify proposals (see the module docstring)."""
    return (p.n == 1 and p.best_of == 1 and p.logprobs is None and p.prompt_logprobs is None
            and p.min_tokens == 0 and not penalised(p) and not p.bad_words_token_ids)


class Speculator:
    def __init__(self, spec: SpeculativeConfig, engine: Any, proposer: Any = None) -> None:
        """proposer: one the engine built already (a draft model, loaded before the KV sizing),
        else make_proposer's."""
        self.spec = spec
        self.proposer = proposer if proposer is not None else make_proposer(spec, engine)
        self.policy = SpeculationPolicy(spec.num_speculative_tokens, spec.spec_disable_batch_tokens,
                                        spec.disable_by_batch_size, spec.min_speculation_yield)
        self.stats = SpecDecodeStats()
        self._target_hf_config = engine.hf_config
        self._costs: dict[int, float] = {}  # id(draft hf_config) -> its cost
        # A proposer that reads token_ids incrementally gets a TokenHistory view (no copy per step);
        # others get a plain list.
        self._views = getattr(self.proposer, "accepts_token_history", False)
        self._proposed: list[Sequence] = []
        # seq_id -> (draft_probs, first row of its proposals) for a proposer that is not one-hot.
        self._draft_rows: dict[int, tuple[torch.Tensor, int]] = {}
        # This step's rows that got proposals and proposals accepted: its yield, seen in clear().
        self._asked = self._accepted = 0
        self._tried = False  # this step's propose() had rows to propose for
        self._shadow: ShadowProbe | None = None  # a shadow probe being scored (begin_step)

    def begin_step(self, scheduler: Any, eligible: set[str], generators: dict[int, torch.Generator],
                   grammars: Any, overlapping: bool, finish_inflight: Callable[[], None]) -> int:
        """This step's k, its proposals filled in (0: none; the step may overlap). overlapping: a
        step is in flight and this one could overlap it. A host-side proposer
        (spec_decode/proposer.py) is asked over the histories the host has (peek, one token
        stale) before the overlap is given up: nothing there keeps the step overlapped. Otherwise
        finish_inflight() ends the step in flight and the proposer runs over fresh histories; a
        host-side one with nothing there either leaves the step overlapped too, counted as an empty
        speculating step only when the wait was paid for it (spec_decode/policy.py)."""
        if self._shadow is not None:
            self._score_shadow(scheduler.running)
        k = self.tokens_this_step(scheduler.num_running)
        if not k:
            return 0
        host_side = self.proposes_on_host
        if host_side and self.policy.probing and hasattr(self.proposer, "peek_proposals"):
            return self._shadow_probe(scheduler, eligible, generators)
        waited = False
        if host_side and overlapping:
            if not self.peek(scheduler.running, eligible, k, generators):
                return 0
            waited = True
        finish_inflight()
        if self.propose(scheduler.running, eligible, k, generators, grammars) or not host_side:
            return k
        if waited:
            self.clear()  # the wait was paid: an empty speculating step
        else:
            self.nothing_to_propose()
        return 0

    def _shadow_probe(self, scheduler: Any, eligible: set[str], generators: dict[int, torch.Generator]) -> int:
        """Take the due probe as a shadow probe (spec_decode/shadow.py): the proposer's proposals
        over the host's histories, at the k the batch rule allows; the step stays as it was (0).
        With nothing proposed for any row the probe stays due (nothing_to_propose)."""
        k = self.policy.batch_k(scheduler.num_running)
        seqs, reqs = self._requests(scheduler.running, eligible, k, generators, stale=True)
        t0 = time.perf_counter()
        found = bool(reqs) and self.proposer.has_proposals(reqs)  # the peek: worth a probe?
        self.stats.proposer_seconds += time.perf_counter() - t0
        if not found:
            self.nothing_to_propose()
            return 0
        # Each row proposes over what a verified probe would see now: the host's history and the
        # token in flight; it is made once that token is on the host, and scored k tokens later.
        rows = {r.seq_id: (len(r.token_ids) + s.num_inflight_tokens, r) for s, r in zip(seqs, reqs)}
        self._shadow = ShadowProbe(k, rows, max_steps=k + SHADOW_SLACK_STEPS)
        self.policy.begin_shadow()
        self.stats.num_shadow_probes += 1
        return 0

    def _score_shadow(self, groups: list[SequenceGroup]) -> None:
        running = {s.seq_id: s for g in groups for s in g.seqs if s.status is RUNNING}

        def history_of(seq_id: int) -> TokenHistory | None:
            s = running.get(seq_id)
            return None if s is None else TokenHistory(s.prompt_token_ids, s.output_token_ids)

        def propose(r: ProposalRequest) -> list[int]:
            t0 = time.perf_counter()
            ids = self.proposer.peek_proposals([r])[0]
            self.stats.proposer_seconds += time.perf_counter() - t0
            return ids

        shadow = self._shadow
        shadow.advance(history_of, propose)
        b = shadow.bounds()
        if b is None:  # every row's sequence ended unscored: the probe stays due
            self._shadow = None
            self.policy.cancel_shadow()
            return
        low, high = b
        threshold = self.policy.threshold(shadow.k)
        if shadow.done or low >= threshold or high < threshold:  # decided: as a verified probe
            self._shadow = None
            self.policy.observe_shadow(low if low >= threshold else high, shadow.k)

    def tokens_this_step(self, num_running: int) -> int:
        paused = self.policy.num_paused_steps
        self.policy.proposer_cost = self._cost(self.proposer)  # a benchmark may swap proposers
        k = self.policy.tokens_to_propose(num_running)
        self.stats.num_paused_steps += self.policy.num_paused_steps - paused  # (a benchmark may swap policies)
        return k

    def _cost(self, proposer: Any) -> float:
        """What one proposed token costs in target steps (spec_decode/policy.py): a draft model's
        weight bytes over the target's (a decode step reads its weights), 0 for a proposer without
        a model (n-gram); a wrapper (spec_decode/synthetic.py) costs what its inner proposer does."""
        inner = getattr(proposer, "inner", None)
        if inner is not None:
            return self._cost(inner)
        cfg = getattr(proposer, "hf_config", None)
        if cfg is None:
            return 0.0
        key = id(cfg)
        if key not in self._costs:
            from pagedserve.model_cost import ModelCost
            self._costs[key] = (ModelCost.from_hf_config(cfg).weight_bytes
                                / ModelCost.from_hf_config(self._target_hf_config).weight_bytes)
        return self._costs[key]

    def idle(self) -> None:
        """The engine has no requests left: the next ones start from a fresh yield estimate, so
        that the same offline batch run twice speculates in the same steps (seeded sampling
        draws alike)."""
        self.policy.reset()
        self._shadow = None

    @property
    def proposes_on_host(self) -> bool:
        """Whether the proposer may be asked has_proposals (spec_decode/proposer.py); looked up
        each step (a benchmark may swap proposers)."""
        return proposes_on_host(self.proposer)

    def _requests(self, groups: list[SequenceGroup], eligible: set[str], k: int,
                  generators: dict[int, torch.Generator], stale: bool) -> tuple[list[Sequence], list[ProposalRequest]]:
        """The running decodes of eligible requests and their ProposalRequests; stale: also those
        with a token in flight, over the history the host has (without that token)."""
        seqs, reqs = [], []
        for g in groups:
            if g.request_id not in eligible or len(g.seqs) != 1:
                continue
            s = g.seqs[0]
            if s.status is not RUNNING or not s.is_decode or (s.num_inflight_tokens and not stale):
                continue
            m = g.sampling_params.max_tokens
            if m is not None and m - len(s.output_token_ids) - s.num_inflight_tokens - 1 < 1:
                continue  # its last token: the scheduler would grant it no lookahead (max_tokens)
            t = g.sampling_params.temperature
            seqs.append(s)
            history = TokenHistory(s.prompt_token_ids, s.output_token_ids) if self._views else s.token_ids
            reqs.append(ProposalRequest(s.seq_id, history, k, t, generators.get(s.seq_id)))
        return seqs, reqs

    def peek(self, groups: list[SequenceGroup], eligible: set[str], k: int,
             generators: dict[int, torch.Generator]) -> bool:
        """While a step is in flight: whether the host-side proposer would propose anything over
        the histories the host has (one token stale). False: the step stays overlapped, as if the
        policy had not asked (nothing_to_propose); True: the engine finishes the step in flight
        and proposes over the fresh histories."""
        _, reqs = self._requests(groups, eligible, k, generators, stale=True)
        t0 = time.perf_counter()
        found = bool(reqs) and self.proposer.has_proposals(reqs)
        self.stats.proposer_seconds += time.perf_counter() - t0
        if not found:
            self.nothing_to_propose()
        return found

    def nothing_to_propose(self) -> None:
        """A host-side proposer had nothing for this step before the step gave up its overlap:
        it runs overlapped, neither paused nor empty for the policy (spec_decode/policy.py)."""
        self.policy.nothing_to_propose()
        self.stats.num_unproposed_steps += 1
        self._tried = False

    def propose(self, groups: list[SequenceGroup], eligible: set[str], k: int,
                generators: dict[int, torch.Generator], grammars: Any = None) -> int:
        """Fill spec_token_ids of the running decodes of eligible requests (at most k each);
        grammars (engine/structured SeqGrammars) trims a constrained sequence's proposals.
        Returns how many sequences got proposals."""
        seqs, reqs = self._requests(groups, eligible, k, generators, stale=False)
        if not reqs:
            return 0
        self._tried = True
        t0 = time.perf_counter()
        proposals = self.proposer.propose(reqs)
        self.stats.proposer_seconds += time.perf_counter() - t0
        row = 0
        for s, ids in zip(seqs, proposals.token_ids):
            if ids and grammars is not None and s.seq_id in grammars:
                ids = _grammar_prefix(grammars.get(s.seq_id), s.output_token_ids, ids[:k])
            if ids:
                s.spec_token_ids = list(ids[:k])
                self._proposed.append(s)
                if proposals.draft_probs is not None:
                    self._draft_rows[s.seq_id] = (proposals.draft_probs, row)
            row += len(ids)
        # The yield counts the rows that got proposals: a row without one costs no verification,
        # and an n-gram that has not matched yet must not pause speculation before it does.
        self._asked = len(self._proposed)
        return self._asked

    def clear(self) -> None:
        """After the step: no proposal outlives it; the policy sees what the step yielded."""
        for s in self._proposed:
            s.spec_token_ids = []
        self._proposed = []
        self._draft_rows = {}
        if self._asked:
            self.policy.observe(1.0 + self._accepted / self._asked)
        elif self._tried:  # rows could take proposals and the proposer had none for any of them
            self.policy.observe_empty()
        self._asked = self._accepted = 0
        self._tried = False

    def finish(self, seq_id: int) -> None:
        self.proposer.finish(seq_id)

    def verify(self, logits: torch.Tensor, sampled: list, sampler: Any, shared: torch.Generator,
               generators: dict[int, torch.Generator], structured: Any = None):
        """Split a step's logits into the ordinary rows' and the speculative rows'; verify the latter.

        Returns (logits of the ordinary rows, their ScheduledSequences, [(speculative row, emitted
        token ids, their raw logprobs)]); sets num_rejected on every speculative row."""
        dev = logits.device
        plain_rows, plain, spec = [], [], []
        off = 0
        for s in sampled:
            if s.num_lookahead:
                spec.append((s, off))
            else:
                plain.append(s)
                plain_rows.append(off)
            off += 1 + s.num_lookahead
        if not spec:
            return logits, sampled, []
        if off != logits.shape[0]:
            raise RuntimeError(f"speculative step: {logits.shape[0]} logits rows for {off} expected")
        plain_logits = logits.index_select(0, to_device(plain_rows, torch.long, dev)) if plain else None
        idx = [o + j for s, o in spec for j in range(1 + s.num_lookahead)]
        target = logits.index_select(0, to_device(idx, torch.long, dev)).float()
        rows, vrows, drafts = [], [], []
        for s, _ in spec:
            seq, p = s.seq, s.group.sampling_params
            gen = generators.get(seq.seq_id)
            for _ in range(1 + s.num_lookahead):
                rows.append(SampleRow(len(rows), p, seq.prompt_token_ids, seq.output_token_ids, gen))
            vrows.append(VerifyRow(seq.spec_token_ids[:s.num_lookahead], p.temperature == 0.0, gen))
            found = self._draft_rows.get(seq.seq_id)
            if found is not None:
                probs, first = found
                drafts.append(probs[first:first + s.num_lookahead])
        if structured is not None and structured.seqs:
            _mask_positions(target, spec, structured)
        probs = sampler.process_logits(target, rows).softmax(dim=-1)
        if drafts and len(drafts) != len(spec):
            raise RuntimeError("a proposer returned draft_probs for some requests only")
        draft_probs = torch.cat(drafts).to(dev) if drafts else None
        # One read of the device for the whole verification, the raw logprobs of the emitted tokens
        # (what decoding without speculation reports) included.
        result = rejection_sample(probs, vrows, draft_probs, shared, logits=target)
        out = []
        self.stats.num_spec_steps += 1
        for (s, _), toks, a, lps in zip(spec, result.token_ids, result.num_accepted, result.logprobs):
            s.num_rejected = s.num_lookahead - a
            self.stats.record(s.num_lookahead, a)
            self._accepted += a
            out.append((s, toks, lps))
        return plain_logits, plain, out


def _grammar_prefix(g: Any, output_token_ids: list[int], ids: list[int]) -> list[int]:
    """The longest prefix of ids the grammar accepts after the sequence's output, stopping before
    a token that would close the grammar (the position after it would have no mask)."""
    g.catch_up(output_token_ids)
    if g.done:
        return []
    m = g.matcher.fork()
    keep = []
    for t in ids:
        if not m.accept_token(t) or m.is_terminated():
            break
        keep.append(t)
    return keep


def _mask_positions(target: torch.Tensor, spec: list, structured: Any) -> None:
    """Mask each constrained row's k + 1 positions: position j with the grammar's state after the
    row's first j proposals (accepted by a copy of the matcher; they passed _grammar_prefix)."""
    from pagedserve.engine.structured.masks import StepMask
    slot, bitmask = structured.masks.take(target.shape[0])
    indices, base = [], 0
    for s, _ in spec:
        g = structured.seqs.get(s.seq.seq_id)
        if g is not None and not g.done:
            g.catch_up(s.seq.output_token_ids)
            m = g.matcher.fork()
            drafts = s.seq.spec_token_ids[:s.num_lookahead]
            for j in range(1 + s.num_lookahead):
                if m.fill_next_token_bitmask(bitmask, base + j):
                    indices.append(base + j)
                if j < len(drafts):
                    m.accept_token(drafts[j])
        base += 1 + s.num_lookahead
    if indices:
        structured.apply(target, StepMask(bitmask, indices[-1] + 1, indices, slot))
