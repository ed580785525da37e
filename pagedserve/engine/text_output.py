"""The server's half of output processing: text, stop strings and output shapes.

The engine core runs without detokenizing: it applies EOS, stop_token_ids, min_tokens and
max_tokens, and streams every request to the server as token-only DELTA outputs (one token per
sequence per step). RequestText turns those into what the request asked for, exactly as
LLMEngine's OutputProcessor does in one process (pagedserve.engine.output_processor; its rules,
in its order):
  - text is detokenized incrementally per token (engine/detokenizer.py);
  - an EOS / stop_token_ids token keeps its id but not its text (unless
    include_stop_str_in_output); the core tells us by finishing with "stop";
  - a stop string (checked once more than min_tokens tokens exist, before the length rule)
    cuts the text and finishes the sequence with "stop": the core knows nothing of it, so the
    caller aborts the request in the core once every sequence is done;
  - while running, text that could be the start of a stop string is held back;
  - outputs take the request's output_kind shape (DELTA, CUMULATIVE, FINAL_ONLY), and with
    best_of > n the best n sequences by cumulative logprob, ranked;
  - the core's logprobs (PositionLogprobs, plain numbers) become vLLM's Logprob dicts here, their
    tokens named by this tokenizer (engine/logprob_tokens.py).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from pagedserve.engine.detokenizer import (added_token_contents, detokenize_incrementally, find_stop_string,
                                           initial_state)
from pagedserve.engine.logprob_tokens import LogprobTokens, output_position, prompt_positions
from pagedserve.logprobs import Logprob
from pagedserve.outputs import CompletionOutput, RequestOutput
from pagedserve.sampling_params import RequestOutputKind, SamplingParams

DELTA, FINAL_ONLY = RequestOutputKind.DELTA, RequestOutputKind.FINAL_ONLY


def core_params(params: SamplingParams) -> SamplingParams:
    """What the core is asked for: token-only DELTA outputs of every sequence (n = best_of, so
    the ranking of best_of > n happens here), no stop strings. Greedy best_of > 1 forks
    identical copies, so the core runs one (n > 1 needs temperature > 0)."""
    n = params.best_of if params.temperature > 0 else 1
    return dataclasses.replace(params, n=n, best_of=n, stop=[], output_kind=DELTA)


def _cut_cumulative(c: CompletionOutput, k: int) -> float | None:
    """The cumulative logprob of c's tokens up to its k-th, where a stop string cuts it: c's own
    counts the tokens the core ran on past it, whose logprobs (where c carries them) come off.
    Without them it is exact only at c's last token (one token a step: _catch_up keeps such
    requests' outputs apart); a cut inside a speculative step's accepted run, which carries no
    logprobs (speculating requests ask for none), reports None, as vLLM does for a request
    without logprobs, rather than a sum that counts the run-on tokens."""
    if k == len(c.token_ids) - 1 or c.cumulative_logprob is None:
        return c.cumulative_logprob
    if c.logprobs is None:
        return None
    # c is a core output: its logprobs are PositionLogprobs, the chosen token's value first.
    return c.cumulative_logprob - sum(c.logprobs[j].logprobs[0] for j in range(k + 1, len(c.token_ids)))


def unnamed_logprobs(out: RequestOutput) -> RequestOutput:
    """A core output as it is (no tokenizer here: no text), but for its logprobs: vLLM's Logprob
    dicts, decoded_token None, in place of the core's PositionLogprobs."""
    if out.prompt_logprobs is None and all(c.logprobs is None for c in out.outputs):
        return out
    outs = [c if c.logprobs is None else dataclasses.replace(c, logprobs=[output_position(p, [], None)
                                                                          for p in c.logprobs])
            for c in out.outputs]
    plp = None if out.prompt_logprobs is None else prompt_positions(out.prompt_logprobs, out.prompt_token_ids, None)
    return dataclasses.replace(out, outputs=outs, prompt_logprobs=plp)


@dataclass
class _SeqText:
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float | None = 0.0  # None: not known (_cut_cumulative)
    text: str = ""
    detok_state: tuple[int, int] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    sent_tokens: int = 0
    sent_text_len: int = 0
    sent_finish: bool = False


class RequestText:
    """One request's text state in the API server."""

    def __init__(self, tokenizer: Any, params: SamplingParams, prompt: str | None,
                 prompt_token_ids: list[int], logprob_tokens: LogprobTokens | None = None) -> None:
        """logprob_tokens: names logprob tokens with this tokenizer (shared: it caches each id's text)."""
        self.tokenizer = tokenizer
        # detokenize=False: no text and logprobs unnamed (decoded_token None), as vLLM's
        self.logprob_tokens = (logprob_tokens or LogprobTokens(tokenizer)) if params.detokenize else None
        self.params = params
        # Only spaces_between_special_tokens=False reads them (engine/detokenizer.py).
        self.added_tokens = None if params.spaces_between_special_tokens or params.skip_special_tokens \
            else added_token_contents(tokenizer)
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        self.num_seqs = core_params(params).n
        self.seqs: dict[int, _SeqText] = {}
        self.finished = False
        self.prompt_logprobs = None  # from the core's first output that carries it
        self.sent_prompt_logprobs = False
        self.hold = max(len(s) for s in params.stop) - 1 \
            if params.stop and not params.include_stop_str_in_output else 0

    def process(self, out: RequestOutput) -> RequestOutput | None:
        """Fold in one core output; returns the request's output to deliver now (None: nothing
        to say yet). Afterwards `finished` tells whether the request is done here."""
        if out.prompt_logprobs is not None:
            self.prompt_logprobs = prompt_positions(out.prompt_logprobs, self.prompt_token_ids,
                                                    self.logprob_tokens)
        for c in out.outputs:
            seq = self.seqs.get(c.index)
            if seq is None:
                seq = self.seqs[c.index] = _SeqText(
                    logprobs=[] if self.params.logprobs is not None else None)
            if seq.finish_reason is None:
                self._append(seq, c)
        done = out.finished or (len(self.seqs) == self.num_seqs
                                and all(s.finish_reason is not None for s in self.seqs.values()))
        if done:
            for seq in self.seqs.values():
                if seq.finish_reason is None:  # ended by the core without a reason of its own
                    seq.finish_reason = "abort"
        self.finished = done
        kind = self.params.output_kind
        if kind is DELTA:
            outs = self._delta_outputs()
            if not outs and not done:
                return None
        elif kind is FINAL_ONLY and not done:
            return None
        else:
            outs = self._cumulative_outputs()
        metrics = out.metrics if out.finished else None
        prompt_lps = self.prompt_logprobs
        if kind is DELTA:
            prompt_lps, self.sent_prompt_logprobs = (None if self.sent_prompt_logprobs else prompt_lps,
                                                     self.sent_prompt_logprobs or prompt_lps is not None)
        return RequestOutput(out.request_id, self.prompt, self.prompt_token_ids, outs, done, metrics,
                             out.error, prompt_lps)

    # ---- one sequence -------------------------------------------------------------------------

    def _detokenize(self, seq: _SeqText, ids: list[int], final: bool) -> str:
        if not self.params.detokenize:
            return ""
        state = seq.detok_state or initial_state(len(self.prompt_token_ids))
        p = self.params
        new_text, seq.detok_state = detokenize_incrementally(
            self.tokenizer, self.prompt_token_ids, ids, state, p.skip_special_tokens, final=final,
            spaces_between_special_tokens=p.spaces_between_special_tokens, added=self.added_tokens)
        seq.text += new_text
        return new_text

    def _append(self, seq: _SeqText, c: CompletionOutput) -> None:
        p = self.params
        if not p.stop and c.token_ids:
            self._append_chunk(seq, c)
            return
        last = len(c.token_ids) - 1
        for k, token in enumerate(c.token_ids):
            if seq.logprobs is not None and c.logprobs is not None:
                seq.logprobs.append(output_position(c.logprobs[k], seq.token_ids, self.logprob_tokens))
            seq.token_ids.append(token)
            core_finish = c.finish_reason if k == last else None
            # The core finishes with "stop" only for EOS / stop_token_ids: this token.
            token_stop = core_finish == "stop"
            hide_token = token_stop and not p.include_stop_str_in_output
            if not hide_token:
                old_len = len(seq.text)
                new_text = self._detokenize(seq, seq.token_ids, final=False)
                if new_text and p.stop and len(seq.token_ids) > p.min_tokens and not token_stop:
                    hit = find_stop_string(seq.text, p.stop, old_len)
                    if hit is not None:
                        i, s = hit
                        seq.text = seq.text[:i + len(s) if p.include_stop_str_in_output else i]
                        seq.finish_reason, seq.stop_reason = "stop", s
                        seq.cumulative_logprob = _cut_cumulative(c, k)
                        return
            if core_finish is not None:
                seq.finish_reason, seq.stop_reason = core_finish, c.stop_reason
                visible = seq.token_ids[:-1] if hide_token else seq.token_ids
                self._detokenize(seq, visible, final=True)
        if not c.token_ids and c.finish_reason is not None:  # "ignored", "abort": no new token
            seq.finish_reason, seq.stop_reason = c.finish_reason, c.stop_reason
        if c.cumulative_logprob is not None:
            seq.cumulative_logprob = c.cumulative_logprob

    def _append_chunk(self, seq: _SeqText, c: CompletionOutput) -> None:
        """_append without stop strings: nothing is decided between the chunk's tokens, so its
        text is decoded once (the same text as token by token: both emit the difference of two
        decodes of one window, engine/detokenizer.py)."""
        base = len(seq.token_ids)
        seq.token_ids.extend(c.token_ids)
        if seq.logprobs is not None and c.logprobs is not None:
            ids = seq.token_ids
            for k, p in enumerate(c.logprobs):  # each position named after the tokens before it
                seq.logprobs.append(output_position(p, ids[max(0, base + k - 4):base + k], self.logprob_tokens))
        if c.finish_reason is None:
            self._detokenize(seq, seq.token_ids, final=False)
        else:
            seq.finish_reason, seq.stop_reason = c.finish_reason, c.stop_reason
            hide_token = c.finish_reason == "stop" and not self.params.include_stop_str_in_output
            self._detokenize(seq, seq.token_ids[:-1] if hide_token else seq.token_ids, final=True)
        if c.cumulative_logprob is not None:
            seq.cumulative_logprob = c.cumulative_logprob

    # ---- output shapes -----------------------------------------------------------------------

    def _visible_len(self, seq: _SeqText) -> int:
        n = len(seq.text)
        return n if not self.hold or seq.finish_reason is not None else max(n - self.hold, 0)

    def _ordered(self) -> list[_SeqText]:
        return [self.seqs[i] for i in sorted(self.seqs)]

    def _cumulative_outputs(self) -> list[CompletionOutput]:
        p = self.params
        seqs = self._ordered()
        if p.best_of > p.n:
            seqs = sorted(seqs, key=lambda s: s.cumulative_logprob, reverse=True)[:p.n]
        return [CompletionOutput(
                    index=i, text=seq.text[:self._visible_len(seq)], token_ids=list(seq.token_ids),
                    cumulative_logprob=seq.cumulative_logprob,
                    logprobs=list(seq.logprobs) if seq.logprobs is not None else None,
                    finish_reason=seq.finish_reason, stop_reason=seq.stop_reason)
                for i, seq in enumerate(seqs)]

    def _delta_outputs(self) -> list[CompletionOutput]:
        outs = []
        for i, seq in enumerate(self._ordered()):
            ids = seq.token_ids
            t0, c0 = seq.sent_tokens, seq.sent_text_len
            end = self._visible_len(seq)
            finished = seq.finish_reason is not None
            if len(ids) == t0 and end <= c0 and (seq.sent_finish or not finished):
                continue
            outs.append(CompletionOutput(
                index=i, text=seq.text[c0:end] if end > c0 else "", token_ids=ids[t0:],
                cumulative_logprob=seq.cumulative_logprob,
                logprobs=seq.logprobs[t0:] if seq.logprobs is not None else None,
                finish_reason=seq.finish_reason, stop_reason=seq.stop_reason))
            seq.sent_tokens = len(ids)
            seq.sent_text_len = max(c0, end)
            seq.sent_finish = finished
        return outs


def beam_search_output(out: RequestOutput, tokenizer: Any | None, skip_special_tokens: bool = True,
                       include_stop_str_in_output: bool = False,
                       logprob_tokens: LogprobTokens | None = None) -> RequestOutput:
    """A finished beam search from the core (token ids only, best first) as vLLM's server makes
    it: each text decoded in one piece, never with the EOS that ended a "stop" hypothesis, and
    that EOS kept in token_ids (so counted in usage) only with include_stop_str_in_output.
    Without a tokenizer here (skip_tokenizer_init) the texts stay empty. Logprobs, where the
    search asked for them, become vLLM's dicts as a sampled request's do (named by
    logprob_tokens; None: unnamed), one per token left in token_ids."""
    outs = []
    for c in out.outputs:
        ids = c.token_ids[:-1] if c.finish_reason == "stop" and c.token_ids else c.token_ids
        text = tokenizer.decode(ids, skip_special_tokens=skip_special_tokens) if tokenizer is not None else ""
        token_ids = list(c.token_ids if include_stop_str_in_output else ids)
        logprobs = None if c.logprobs is None else \
            [output_position(p, token_ids[max(0, i - 4):i], logprob_tokens)
             for i, p in enumerate(c.logprobs[:len(token_ids)])]
        outs.append(dataclasses.replace(c, text=text, token_ids=token_ids, logprobs=logprobs))
    return dataclasses.replace(out, outputs=outs)
