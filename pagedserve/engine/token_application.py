"""The half of LLMEngine (llm_engine.py) that turns a step's logits into appended tokens.

Sampling on the device, then for every row: its token appended (OutputProcessor: detokenize,
stop rules), forks for best_of > 1 made before the parent appends, beam-search rows handed to
the beam driver, finished sequences freed in the scheduler. Overlapped steps arrive here one
step late (_process_inflight): rows of sequences that ended meanwhile are discarded, and a block
whose last token just arrived is offered to the prefix cache. Everything here acts on the
engine's own state; the mixin holds none of its own.
"""
from __future__ import annotations

import time
from typing import Any

import torch

from pagedserve.engine.bad_words import banned_tokens
from pagedserve.engine.inflight import InflightStep
from pagedserve.engine.structured.matchers import SeqGrammars
from pagedserve.layers.sampler import DeviceSample, SampleRow, derive_seed, penalised, to_device
from pagedserve.sequence import Sequence, SequenceGroup, SequenceStatus


class TokenApplication:
    """Mixin of LLMEngine: sampled tokens into sequences."""

    # ---- grammars (engine/structured/): masks before sampling, termination after appending ----

    def _grammar_rows(self, sampled: list, prev: "InflightStep | None" = None) -> list:
        """(logits row, SeqGrammar, output tokens, pending token) of the step's constrained rows,
        in row order, for StructuredOutputs.advance_and_fill. prev: the overlapped step before,
        whose sampled tokens the host has not appended yet (`pending`); its ids are waited for
        only if a constrained row has one in flight."""
        grammar_of = self.structured.seqs.get
        rows = []
        prev_ids = None
        for i, s in enumerate(sampled):
            seq = s.seq
            g = grammar_of(seq.seq_id)
            if g is None:
                continue
            pending = None
            if prev is not None and seq.num_inflight_tokens:
                if prev_ids is None:
                    prev_ids = prev.copy.result().token_ids
                pending = prev_ids[seq.inflight_sample_row]
            rows.append((i, g, seq.output_token_ids, pending))
        return rows

    def _mask_logits(self, logits: torch.Tensor, sampled: list, prev: "InflightStep | None" = None,
                     alongside: Any = None) -> None:
        """The step's mask. Overlapped (prev: the step before, still in flight): wait for its
        tokens (already sampled on the device; this step's forward is queued behind them, so the
        device keeps busy), feed them to the matchers, fill this step's rows on the host and mask
        the logits on the device. Synchronous: the matchers took every token already.
        alongside (overlapped steps, PAGEDSERVE_GRAMMAR_FILL=overlap): host work run on a helper
        thread while this thread fills the rows: the engine processes prev's tokens there, which
        otherwise follows the sampler's launch. Only when there are rows to fill: without, the
        engine processes them after the launch, as inline."""
        rows = self._grammar_rows(sampled, prev)
        mask = self.structured.advance_and_fill(rows, alongside if rows else None)
        self.structured.apply(logits, mask)

    def _grammar_ended(self, seqs) -> list[tuple[Sequence, SequenceStatus]]:
        """Constrained sequences (just appended, not finished by the stop rules; (seq, group)
        pairs) whose grammar has closed: "stop" (its stop token accepted, also under ignore_eos),
        or "abort" if it refused a token. The mask allows only what it accepts, so that happens
        only when the mask allowed nothing the draw could take: the request's other settings
        (allowed_token_ids, bad_words, min_tokens) exclude every token the grammar accepts there,
        or the grammar has a dead end. The group's error says so (the server answers 400, not
        an empty "abort"). With overlapped steps the matchers took these tokens already (to fill
        the next mask), so a row costs a look-up."""
        grammar_of = self.structured.seqs.get
        rows, behind = [], []
        for seq, group in seqs:
            g = grammar_of(seq.seq_id)
            if g is None:
                continue
            rows.append((seq, group, g))
            if g.num_accepted != len(seq.output_token_ids):
                behind.append((g, seq.output_token_ids, None))
        if behind:
            SeqGrammars.advance(behind)
        ended = []
        for seq, group, g in rows:
            if not g.done or seq.status.finished:
                continue
            if g.rejected and group.error is None:
                group.error = (f"structured_outputs: after {g.num_accepted - 1} output tokens the grammar accepts "
                               "no token the request may draw: allowed_token_ids, bad_words or min_tokens "
                               "exclude all it accepts there, or the grammar has a dead end")
            ended.append((seq, SequenceStatus.FINISHED_ABORTED if g.rejected else SequenceStatus.FINISHED_STOPPED))
        return ended

    def _sample_device(self, logits: torch.Tensor, sampled: list, prev_tokens: torch.Tensor | None = None
                       ) -> DeviceSample:
        """An overlapped step's draw, on the device. prev_tokens: the step in flight's sampled ids
        (a sequence's token there is not in its output_token_ids yet: penalties take it from here)."""
        get = self._plain_sampling.get
        temps = [get(s.group.request_id) for s in sampled]
        if None not in temps and (all(temps) or not any(temps)):
            return self.sampler.sample_plain_device(logits, temps)
        gens = self._seq_generators
        rows = [SampleRow(i, s.group.sampling_params, s.seq.prompt_token_ids, s.seq.output_token_ids,
                          gens.get(s.seq.seq_id), self._min_tokens_suppress(s)) for i, s in enumerate(sampled)]
        pending = None
        if prev_tokens is not None and any(penalised(r.params) for r in rows):
            index = [s.seq.inflight_sample_row if s.seq.num_inflight_tokens else -1 for s in sampled]
            if any(i >= 0 for i in index):
                idx = to_device(index, torch.long, logits.device)
                pending = torch.where(idx >= 0, prev_tokens[idx.clamp(min=0)].long(), logits.shape[-1])
        return self.sampler.sample_device(logits, rows, pending)

    def _min_tokens_suppress(self, s) -> list[int]:
        """The stop tokens this row must not draw yet (min_tokens). Overlapped, the host's output
        lags by the tokens still in flight; their count is known, so the rule needs no sync. A
        constrained output's grammar decides when it may end (masking its stop token too could
        leave no token at all)."""
        p, seq = s.group.sampling_params, s.seq
        # Overlapped requests have one-token bad words only (bad_words.needs_host_tail): a fixed ban.
        banned = banned_tokens(p, []) if p.bad_words_token_ids else []
        if len(seq.output_token_ids) + seq.num_inflight_tokens >= p.min_tokens or seq.seq_id in self.structured.seqs:
            return banned
        return banned + list(self.output_processor.stop_token_ids(s.group))

    def _process_inflight(self, step: InflightStep, touched: dict, final_only: bool) -> None:
        """Wait for a launched step's tokens and append them: placeholders become tokens. Rows of
        sequences that ended meanwhile (a stop in the step before, an abort) are discarded."""
        result = step.copy.result()
        self.step_timer.mark("wait")
        now = time.time()
        live, tokens, logprobs, tops = [], [], [], []
        for s, token, logprob, top in zip(step.sampled, result.token_ids, result.logprobs, result.position_logprobs):
            seq = s.seq
            seq.num_inflight_tokens -= 1
            if seq.status.finished:
                continue
            live.append(s)
            tokens.append(token)
            logprobs.append(logprob)
            tops.append(top)
            group = s.group
            if group.first_token_time is None or not final_only:
                self._note_sampled(group, now, touched, final_only)
        if self.output_processor.tokenizer is None and not any(t is not None for t in tops):
            done = self.output_processor.append_plain_tokens(live, tokens, logprobs)
        else:  # text to detokenize, or logprobs to keep
            append = self.output_processor.append_token
            done = []
            for s, token, logprob, top in zip(live, tokens, logprobs, tops):
                status = append(s.seq, s.group, token, logprob, top)
                if status is not None:
                    done.append((s.seq, status))
        if self.structured.seqs:
            ending = {id(seq) for seq, _ in done}
            done += self._grammar_ended((s.seq, s.group) for s in live if id(s.seq) not in ending)
        if done:
            group_of = {s.seq.seq_id: s.group for s in live}
            for seq, status in done:
                self._end_seq(seq, group_of[seq.seq_id], status, touched)
        if self.cache_config.enable_prefix_caching:
            # A block whose last token just arrived can be cached now (its KV is computed).
            bs, arrived = self.cache_config.block_size, self.scheduler.token_arrived
            for s in live:
                seq = s.seq
                if seq.num_known_tokens % bs == 0 and not seq.status.finished:
                    arrived(seq)

    def _end_seq(self, seq: Sequence, group: SequenceGroup, status: SequenceStatus, touched: dict) -> None:
        was_waiting = seq.status is SequenceStatus.WAITING
        seq.status = status
        self.scheduler.free_seq(seq)
        if was_waiting:
            # Preempted for recompute while its last token was in flight, and that token ended it.
            self.scheduler.drop_finished_waiting(group)
            touched[id(group)] = group

    def _process_samples(self, logits: torch.Tensor, sampled: list) -> None:
        get = self._plain_sampling.get
        temps = [get(s.group.request_id) for s in sampled]
        if None not in temps and (all(temps) or not any(temps)):
            self._process_plain_samples(logits, sampled, temps)
            return
        rows: list[SampleRow] = []
        targets: list[tuple[Any, int]] = []  # (scheduled seq, fork index) per row
        beam_rows: list[tuple[Any, int]] = []
        for i, s in enumerate(sampled):
            if s.group.request_id in self._beams:
                beam_rows.append((s, i))
                continue
            p = s.group.sampling_params
            seq = s.seq
            # The grammar decides when a constrained output may end: min_tokens does not hold back
            # the stop token it allows (masking it too could leave no token at all).
            suppress = self.output_processor.stop_token_ids(s.group) \
                if len(seq.output_token_ids) < p.min_tokens and seq.seq_id not in self.structured.seqs else []
            if p.bad_words_token_ids:
                suppress = list(suppress) + banned_tokens(p, seq.output_token_ids)
            first_fork = p.best_of > 1 and len(s.group.seqs) == 1 and not seq.output_token_ids
            for j in range(p.best_of if first_fork else 1):
                if j == 0:
                    gen = self._seq_generators.get(seq.seq_id)
                else:
                    gen = None if p.seed is None else self._make_generator(derive_seed(p.seed, j))
                rows.append(SampleRow(i, p, seq.prompt_token_ids, seq.output_token_ids, gen, suppress))
                targets.append((s, j))
        if rows:
            result = self._draw(lambda: self.sampler.sample_device(logits, rows))
            forks: dict[int, Sequence] = {}
            # Fork first: children copy the parent's tokens before the parent appends its own.
            for r, (s, j) in enumerate(targets):
                if j > 0:
                    child = s.seq.fork()
                    self.scheduler.fork_seq(s.seq, child)
                    self.structured.seqs.fork(s.seq.seq_id, child.seq_id)
                    s.group.seqs.append(child)
                    if rows[r].generator is not None:
                        self._seq_generators[child.seq_id] = rows[r].generator
                    forks[r] = child
            for r, (s, j) in enumerate(targets):
                seq = forks.get(r, s.seq)
                status = self.output_processor.append_token(
                    seq, s.group, result.token_ids[r], result.logprobs[r], result.position_logprobs[r])
                if status is None and self.structured.seqs:
                    status = next((st for _, st in self._grammar_ended([(seq, s.group)])), None)
                if status is not None:
                    seq.status = status
                    self.scheduler.free_seq(seq)
                    self._seq_generators.pop(seq.seq_id, None)
        if beam_rows:
            self._beams.step(logits, beam_rows)

    def _append_verified(self, verified: list) -> None:
        """Speculative rows (engine/speculation.py): append each row's emitted tokens one by one
        through the stop rules, so a stop inside an accepted run truncates exactly there; then the
        blocks the verified tokens filled join the prefix cache."""
        append = self.output_processor.append_token
        cache = self.scheduler.kv_cache_manager.cache_blocks
        for s, tokens, logprobs in verified:
            seq = s.seq
            if seq.status.finished:
                continue
            status = None
            for token, logprob in zip(tokens, logprobs):
                status = append(seq, s.group, token, logprob, None)
                if status is not None:
                    break
            if status is None and self.structured.seqs:
                # Only the last token can close a grammar (proposals never include a closing one).
                status = next((st for _, st in self._grammar_ended([(seq, s.group)])), None)
            if status is not None:
                seq.status = status
                self.scheduler.free_seq(seq)
            else:
                cache(seq)

    def _draw(self, launch):
        """Launch a synchronous step's sampling, then wait for its tokens on the host; the step
        timer splits the wait from the launch."""
        timer = self.step_timer
        timer.mark("postprocess")
        drawn = launch()
        timer.launch_end()
        result = drawn.to_host()
        timer.mark("sample")
        return result

    def _process_plain_samples(self, logits: torch.Tensor, sampled: list, temps: list[float]) -> None:
        """Every row needs only its temperature (no seeds, filters, penalties, logprobs, forks)."""
        result = self._draw(lambda: self.sampler.sample_plain_device(logits, temps))
        if self.output_processor.tokenizer is None:
            free = self.scheduler.free_seq
            done = self.output_processor.append_plain_tokens(sampled, result.token_ids, result.logprobs)
            if self.structured.seqs:
                ending = {id(seq) for seq, _ in done}
                done += self._grammar_ended((s.seq, s.group) for s in sampled if id(s.seq) not in ending)
            for seq, status in done:
                seq.status = status
                free(seq)
            return
        append = self.output_processor.append_token
        for s, token, logprob in zip(sampled, result.token_ids, result.logprobs):
            seq = s.seq
            status = append(seq, s.group, token, logprob, None)
            if status is None and self.structured.seqs:
                status = next((st for _, st in self._grammar_ended([(seq, s.group)])), None)
            if status is not None:
                seq.status = status
                self.scheduler.free_seq(seq)
