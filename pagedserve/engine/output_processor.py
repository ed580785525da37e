"""After sampling: append the token, detokenize, decide whether the sequence stops; build outputs.

Stop rules (vLLM / OpenAI semantics), checked in this order after each appended token:
  1. EOS (unless ignore_eos) or a token in stop_token_ids -> "stop"; the token stays in
     token_ids, its text is left out unless include_stop_str_in_output.
  2. A stop string appears in the text -> "stop"; the text is cut before it (after it with
     include_stop_str_in_output).
  3. max_tokens generated, or the sequence reached max_model_len -> "length".
  4. repetition_detection: the output ends in a repeated pattern -> "repetition" (stop_reason
     "repetition_detected"; vLLM's, from min_tokens tokens on).
Rules 1 and 2 only apply once more than min_tokens tokens exist (the sampler also masks EOS
and stop_token_ids until then).
"""
from __future__ import annotations

import time
from typing import Any

from pagedserve.engine import prompt_logprobs
from pagedserve.engine.detokenizer import (added_token_contents, detokenize_incrementally, find_stop_string,
                                           initial_state)
from pagedserve.engine.logprob_tokens import LogprobTokens, output_position, prompt_positions
from pagedserve.engine.repetition import STOP_REASON as REPETITION, ends_in_repetition
from pagedserve.logprobs import PositionLogprobs
from pagedserve.outputs import CompletionOutput, RequestOutput
from pagedserve.sampling_params import RequestOutputKind
from pagedserve.sequence import Sequence, SequenceGroup, SequenceStatus


class OutputProcessor:
    def __init__(self, tokenizer: Any | None, eos_token_ids: set[int], max_model_len: int,
                 logprob_objects: bool = True):
        """logprob_objects: outputs carry vLLM's Logprob dicts, their tokens named by `tokenizer`
        (None: decoded_token None); False in an engine core that serves the API server, whose
        outputs keep the plain PositionLogprobs (the server makes the dicts)."""
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len
        self.logprob_objects = logprob_objects
        self.logprob_tokens = LogprobTokens(tokenizer) if tokenizer is not None and logprob_objects else None
        self.added_tokens = added_token_contents(tokenizer) if tokenizer is not None else None

    def _names(self, p: Any) -> LogprobTokens | None:
        """Who names a request's logprob tokens: nobody under detokenize=False (decoded_token
        None, as vLLM's output processor drops the tokenizer for such a request)."""
        return self.logprob_tokens if p.detokenize else None

    def stop_token_ids(self, group: SequenceGroup) -> list[int]:
        """Tokens that end the sequence (what min_tokens must suppress)."""
        p = group.sampling_params
        ids = list(p.stop_token_ids)
        if not p.ignore_eos:
            ids += [t for t in self.eos_token_ids if t not in ids]
        return ids

    def append_token(self, seq: Sequence, group: SequenceGroup, token: int, logprob: float,
                     top: PositionLogprobs | None) -> SequenceStatus | None:
        """Append one sampled token; returns the FINISHED_* status if the sequence is done.
        top: the token's logprobs, for a request that asked for them."""
        p = group.sampling_params
        if top is not None and p.logprobs is not None:
            if self.logprob_objects:
                top = output_position(top, seq.output_token_ids, self._names(p))
        else:
            top = None
        seq.append_token(token, logprob, top)
        n_out = len(seq.output_token_ids)
        past_min = n_out > p.min_tokens
        token_stop = past_min and (token in p.stop_token_ids
                                   or (not p.ignore_eos and token in self.eos_token_ids))
        status: SequenceStatus | None = None
        if token_stop:
            status = SequenceStatus.FINISHED_STOPPED
            seq.stop_reason = token if token in p.stop_token_ids else None
        hide_token = token_stop and not p.include_stop_str_in_output
        stop_hit = None
        detok = self.tokenizer is not None and p.detokenize
        if detok and not hide_token:
            old_len = len(seq.output_text)
            new_text = self._detokenize(seq, group, seq.output_token_ids, final=False)
            if new_text and p.stop and past_min and not token_stop:
                stop_hit = find_stop_string(seq.output_text, p.stop, old_len)
                if stop_hit is not None:
                    i, s = stop_hit
                    seq.output_text = seq.output_text[:i + len(s) if p.include_stop_str_in_output else i]
                    seq.stop_reason = s
                    status = SequenceStatus.FINISHED_STOPPED
        if status is None and (n_out >= (p.max_tokens or self.max_model_len)
                               or len(seq.prompt_token_ids) + n_out >= self.max_model_len):
            status = SequenceStatus.FINISHED_LENGTH
        if status is None and p.repetition_detection is not None and n_out >= p.min_tokens \
                and ends_in_repetition(seq.output_token_ids, p.repetition_detection):
            status, seq.stop_reason = SequenceStatus.FINISHED_REPETITION, REPETITION
        if status is not None and detok and stop_hit is None:
            visible = seq.output_token_ids[:-1] if hide_token else seq.output_token_ids
            self._detokenize(seq, group, visible, final=True)
        return status

    def append_plain_tokens(self, sampled: list, token_ids: list[int],
                            logprobs: list[float]) -> list[tuple[Sequence, SequenceStatus]]:
        """append_token for a whole step of plain rows (scheduled sequences whose requests keep no
        logprobs), with no tokenizer: no text, so no stop strings; rules 1 and 3 on plain ints.
        Returns the (seq, FINISHED_* status) pairs of the sequences that are done."""
        if self.tokenizer is not None:
            raise ValueError("append_plain_tokens is for engines without a tokenizer")
        eos = self.eos_token_ids
        max_len = self.max_model_len
        stopped, length = SequenceStatus.FINISHED_STOPPED, SequenceStatus.FINISHED_LENGTH
        done: list[tuple[Sequence, SequenceStatus]] = []
        for s, token, logprob in zip(sampled, token_ids, logprobs):
            seq = s.seq
            p = s.group.sampling_params
            out = seq.output_token_ids
            out.append(token)
            seq.cumulative_logprob += logprob
            n_out = len(out)
            if n_out > p.min_tokens:
                if token in p.stop_token_ids:
                    seq.stop_reason = token
                    done.append((seq, stopped))
                    continue
                if not p.ignore_eos and token in eos:
                    seq.stop_reason = None
                    done.append((seq, stopped))
                    continue
            if n_out >= (p.max_tokens or max_len) or len(seq.prompt_token_ids) + n_out >= max_len:
                done.append((seq, length))
            elif p.repetition_detection is not None and n_out >= p.min_tokens \
                    and ends_in_repetition(out, p.repetition_detection):
                seq.stop_reason = REPETITION
                done.append((seq, SequenceStatus.FINISHED_REPETITION))
        return done

    def _detokenize(self, seq: Sequence, group: SequenceGroup, output_ids: list[int], final: bool) -> str:
        state = seq.detok_state or initial_state(seq.num_prompt_tokens)
        p = group.sampling_params
        new_text, seq.detok_state = detokenize_incrementally(
            self.tokenizer, seq.prompt_token_ids, output_ids, state, p.skip_special_tokens,
            final=final, spaces_between_special_tokens=p.spaces_between_special_tokens,
            added=self.added_tokens)
        seq.output_text += new_text
        return new_text

    def make_output(self, group: SequenceGroup) -> RequestOutput:
        """The request's output in its sampling_params.output_kind shape.

        While running, text that may still turn out to be the start of a stop string is held
        back, so a sequence's visible text only ever grows and a stream never takes text back.
        CUMULATIVE and FINAL_ONLY (asked for only once finished) copy everything generated;
        DELTA slices from each sequence's sent_* offsets and advances them: O(new) per step.
        """
        p = group.sampling_params
        hold = 0
        if p.stop and not p.include_stop_str_in_output:
            hold = max(len(s) for s in p.stop) - 1
        if p.output_kind is RequestOutputKind.DELTA:
            outs = self._delta_outputs(group, hold)
        else:
            outs = self._cumulative_outputs(group, hold)
        finished = group.finished
        if finished and "finished_time" not in group.metrics:
            group.metrics["finished_time"] = time.time()
        plp = prompt_logprobs.for_output(group)
        if plp is not None and self.logprob_objects:
            if group.prompt_logprob_dicts is None:  # made once: a CUMULATIVE request carries it every step
                group.prompt_logprob_dicts = prompt_positions(plp, group.prompt_token_ids,
                                                              self._names(group.sampling_params))
            plp = group.prompt_logprob_dicts
        return RequestOutput(request_id=group.request_id, prompt=group.prompt,
                             prompt_token_ids=group.prompt_token_ids, outputs=outs,
                             finished=finished, metrics=dict(group.metrics), error=group.error,
                             prompt_logprobs=plp)

    @staticmethod
    def _visible_len(seq: Sequence, hold: int) -> int:
        n = len(seq.output_text)
        return n if not hold or seq.status.finished else max(n - hold, 0)

    def _cumulative_outputs(self, group: SequenceGroup, hold: int) -> list[CompletionOutput]:
        p = group.sampling_params
        seqs = group.seqs
        if p.best_of > p.n:
            seqs = sorted(seqs, key=lambda s: s.cumulative_logprob, reverse=True)[:p.n]
        return [CompletionOutput(
                    index=i, text=seq.output_text[:self._visible_len(seq, hold)],
                    token_ids=list(seq.output_token_ids), cumulative_logprob=seq.cumulative_logprob,
                    logprobs=list(seq.output_logprobs) if p.logprobs is not None else None,
                    finish_reason=seq.status.finish_reason, stop_reason=seq.stop_reason)
                for i, seq in enumerate(seqs)]

    def _delta_outputs(self, group: SequenceGroup, hold: int) -> list[CompletionOutput]:
        """One CompletionOutput per sequence with something unsent (tokens, text, or its
        finish_reason), carrying only that; index is the sequence's place in the group
        (stable: DELTA requires best_of == n, so no re-ranking)."""
        keep_logprobs = group.sampling_params.logprobs is not None
        outs = []
        for i, seq in enumerate(group.seqs):
            ids = seq.output_token_ids
            t0, c0 = seq.sent_tokens, seq.sent_text_len
            end = self._visible_len(seq, hold)
            finished = seq.status.finished
            if len(ids) == t0 and end <= c0 and (seq.sent_finish or not finished):
                continue
            outs.append(CompletionOutput(
                index=i, text=seq.output_text[c0:end] if end > c0 else "", token_ids=ids[t0:],
                cumulative_logprob=seq.cumulative_logprob,
                logprobs=seq.output_logprobs[t0:] if keep_logprobs else None,
                finish_reason=seq.status.finish_reason, stop_reason=seq.stop_reason))
            seq.sent_tokens = len(ids)
            seq.sent_text_len = max(c0, end)
            seq.sent_finish = finished
        return outs
