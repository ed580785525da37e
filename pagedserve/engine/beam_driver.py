"""The engine's side of beam search: logits in, forks and frees out.

beam_search.py decides which continuations live (pure bookkeeping); this driver turns each
step's logits into that bookkeeping's input and its answer into scheduler operations (forks
that share blocks, frees), and assembles the finished request's result: a BeamSearchOutput kept
for LLM.beam_search to take, or, for a search the engine core runs for the API server, a
RequestOutput that step() returns like any other (token ids, and the logprobs it asked for, as
plain numbers: the server names them).

Logprobs ride along for free: each step's top tokens are host lists step() computes anyway
(one topk, one .tolist()); a beam keeps one (ids, values) record per token it generated in its
Sequence's output_logprobs, which fork() copies, so a child holds its parent's records and
appends its own. A finished hypothesis turns its records into vLLM's dicts (BeamSearchSequence)
or, for the server and only when asked, PositionLogprobs.
"""
from __future__ import annotations

import time
from typing import Any

import torch

from pagedserve.engine.beam_search import BeamSearchState, Hypothesis, LiveBeam
from pagedserve.engine.logprob_tokens import LogprobTokens
from pagedserve.logprobs import Logprob, PositionLogprobs
from pagedserve.outputs import BeamSearchOutput, BeamSearchSequence, CompletionOutput, RequestOutput
from pagedserve.sequence import Sequence, SequenceGroup, SequenceStatus


class BeamSearchDriver:
    """Beam-search requests of one engine: their states (by request id) and finished results."""

    def __init__(self, scheduler: Any, tokenizer: Any | None, grammars: Any | None = None) -> None:
        """grammars: the engine's per-sequence grammar state (structured/matchers.SeqGrammars), whose
        matchers follow the beams' forks and frees; a constrained beam's logits arrive masked."""
        self.scheduler, self.tokenizer, self.grammars = scheduler, tokenizer, grammars
        self.states: dict[str, BeamSearchState] = {}
        self.results: dict[str, BeamSearchOutput] = {}
        # Searches whose result step() returns as a RequestOutput instead of keeping it in results.
        self.emitting: set[str] = set()
        self._names: LogprobTokens | None = None  # made on first use: only offline results name tokens

    def __contains__(self, request_id: str) -> bool:
        return request_id in self.states

    def add(self, request_id: str, state: BeamSearchState, emit_output: bool = False) -> None:
        self.states[request_id] = state
        if emit_output:
            self.emitting.add(request_id)

    def discard(self, request_id: str) -> None:
        self.states.pop(request_id, None)
        self.emitting.discard(request_id)

    def step(self, logits: torch.Tensor, beam_rows: list) -> None:
        idx = torch.tensor([i for _, i in beam_rows], device=logits.device)
        # Raw log-probabilities, whatever the temperature (BeamSearchParams says why).
        x = logits.index_select(0, idx).float()
        # One topk serves both: the first num_candidates are the search's, all are the step's logprobs.
        k = max(self.states[s.group.request_id].num_logprobs for s, _ in beam_rows)
        vals, ids = torch.log_softmax(x, dim=-1).topk(min(k, x.shape[-1]), dim=-1)
        vals, ids = vals.tolist(), ids.tolist()
        touched = {}
        for r, (s, _) in enumerate(beam_rows):
            state = self.states[s.group.request_id]
            if len(ids[r]) > state.num_logprobs:  # another search in the batch asked for more
                ids[r], vals[r] = ids[r][:state.num_logprobs], vals[r][:state.num_logprobs]
            # A grammar's mask leaves -inf for forbidden tokens: they are no candidates at all. A
            # mask that forbids every token leaves NaN (log_softmax of all -inf): none either.
            keep = [j for j, v in enumerate(vals[r]) if v > float("-inf")]
            if len(keep) < len(vals[r]):
                ids[r], vals[r] = [ids[r][j] for j in keep], [vals[r][j] for j in keep]
            state.pending[s.seq.seq_id] = (ids[r], vals[r])
            touched[s.group.request_id] = s.group
        for rid, group in touched.items():
            state = self.states[rid]
            live = [s for s in group.seqs if not s.status.finished]
            # The scheduler may run a group's beams in different steps (e.g. after a swap-in);
            # the search advances once every live beam has its next-token distribution.
            if all(s.seq_id in state.pending for s in live):
                beams = [(s, *state.pending[s.seq_id]) for s in live]
                state.pending.clear()
                self._advance(group, state, beams)

    def _advance(self, group: SequenceGroup, state: BeamSearchState, beams: list) -> None:
        n = state.num_candidates
        if not any(tid for _, tid, _ in beams) and not state.finished and group.error is None:
            # Every beam's grammar allows nothing here and no hypothesis has finished: the search
            # ends with no result; the group's error says why (the server answers 400).
            group.error = (f"structured_outputs: after {len(beams[0][0].output_token_ids)} output tokens the "
                           "grammar accepts no token on any beam: it has a dead end, or matches no text")
        # A beam's records: this step's whole top list, shared by every child it forks.
        records = [(tid, lps) for _, tid, lps in beams]
        conts = state.step([LiveBeam(seq.output_token_ids, seq.cumulative_logprob, tid[:n], lps[:n],
                                     seq.output_logprobs, rec)
                            for (seq, tid, lps), rec in zip(beams, records)])
        children: dict[int, list] = {}
        for c in conts:
            children.setdefault(c.parent, []).append(c)
        new_seqs: list[Sequence] = []
        for b, (seq, _, _) in enumerate(beams):
            if b not in children:
                seq.status = SequenceStatus.FINISHED_ABORTED
                self.scheduler.free_seq(seq)
                if self.grammars is not None:
                    self.grammars.free(seq.seq_id)
        for b, (seq, _, _) in enumerate(beams):
            mine = children.get(b, [])
            for c in mine[1:]:
                child = seq.fork()
                self.scheduler.fork_seq(seq, child)
                if self.grammars is not None:
                    self.grammars.fork(seq.seq_id, child.seq_id)  # before the parent's token is fed
                child.append_token(c.token, c.logprob, records[b])
                new_seqs.append(child)
            if mine:
                seq.append_token(mine[0].token, mine[0].logprob, records[b])
                new_seqs.append(seq)
        if state.done:
            for seq in new_seqs:
                seq.status = SequenceStatus.FINISHED_STOPPED
                self.scheduler.free_seq(seq)
        # Dead beams leave the group once freed, so the group never grows past beam_width.
        group.seqs[:] = new_seqs or [beams[0][0]]

    def finish(self, group: SequenceGroup) -> RequestOutput | None:
        """The search of this finished group: its RequestOutput if step() is to return it,
        else None (its BeamSearchOutput waits in results)."""
        rid = group.request_id
        state = self.states.pop(rid)
        prompt = group.prompt_token_ids
        if not state.done:
            # Ended from outside the search (the scheduler ran out of cache): the live beams
            # count as length-finished hypotheses.
            state.finish_live([(s.output_token_ids, s.cumulative_logprob, s.output_logprobs)
                               for s in group.seqs if s.output_token_ids])
        if rid in self.emitting:
            self.emitting.discard(rid)
            return self._request_output(group, state)
        seqs = []
        for h in state.best():
            out_text = full_text = None
            if self.tokenizer is not None:
                out_text = self.tokenizer.decode(h.output_tokens, skip_special_tokens=True)
                full_text = self.tokenizer.decode(prompt + h.output_tokens, skip_special_tokens=True)
            seqs.append(BeamSearchSequence(tokens=prompt + h.output_tokens, cum_logprob=h.cum_logprob,
                                           score=h.score, output_tokens=h.output_tokens, text=full_text,
                                           output_text=out_text, finish_reason=h.finish_reason,
                                           logprobs=self._logprob_dicts(h)))
        self.results[rid] = BeamSearchOutput(sequences=seqs)
        return None

    def _logprob_dicts(self, h: Hypothesis) -> list[dict[int, Logprob]]:
        """BeamSearchSequence.logprobs: each step's top tokens in rank order, named as sampled
        logprobs are (engine/logprob_tokens.py: context, the hypothesis' tokens before it)."""
        if self.tokenizer is not None and self._names is None:
            self._names = LogprobTokens(self.tokenizer)
        out = []
        for i, (ids, vals) in enumerate(h.steps):
            # Naming looks back 4 tokens at most (a split UTF-8 character): no longer slices.
            names = self._names.texts(ids, h.output_tokens[max(0, i - 4):i]) if self._names else [None] * len(ids)
            out.append({t: Logprob(v, r, name) for r, (t, v, name) in enumerate(zip(ids, vals, names), 1)})
        return out

    @staticmethod
    def _positions(h: Hypothesis, k: int) -> list[PositionLogprobs]:
        """What the server's logprobs need of each step, in the shape of a sampled token's: the
        chosen token first (its rank: its place in the step's list; it was a candidate), then the
        top k."""
        out = []
        for t, (ids, vals) in zip(h.output_tokens, h.steps):
            j = ids.index(t)
            out.append(PositionLogprobs([t, *ids[:k]], [vals[j], *vals[:k]], j + 1))
        return out

    @classmethod
    def _request_output(cls, group: SequenceGroup, state: BeamSearchState) -> RequestOutput:
        """One CompletionOutput per hypothesis, best first; an EOS-ended one keeps its EOS in
        token_ids, and names it as stop_reason (as vLLM's server does); logprobs only when the
        search asked for them (they cross to the server). A search that never ran (the
        scheduler ignored the group, its grammar failed) reports the group's own finish reason
        and error, as any other request would."""
        k = state.params.logprobs
        outs = [CompletionOutput(index=i, text="", token_ids=list(h.output_tokens), cumulative_logprob=h.cum_logprob,
                                 logprobs=None if k is None else cls._positions(h, k), finish_reason=h.finish_reason,
                                 stop_reason=h.output_tokens[-1] if h.finish_reason == "stop" else None)
                for i, h in enumerate(state.best())]
        if not outs:
            outs = [CompletionOutput(0, "", [], None, None, group.seqs[0].status.finish_reason or "abort")]
        group.metrics.setdefault("finished_time", time.time())
        return RequestOutput(group.request_id, group.prompt, group.prompt_token_ids, outs, finished=True,
                             metrics=dict(group.metrics), error=group.error)
