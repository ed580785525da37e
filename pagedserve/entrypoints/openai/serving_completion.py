"""POST /v1/completions: prompts (text or token ids, one or many) -> text, streamed or not."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from itertools import islice
from typing import Any, AsyncIterator

from pydantic_core import to_json

from pagedserve.engine.async_engine import EngineDeadError
from pagedserve.engine.input_processor import truncated_prompt
from pagedserve.engine.request_stream import RequestStream
from pagedserve.entrypoints.openai.beam_search import beam_search_params, check_beam_search
from pagedserve.entrypoints.openai.logprob_names import finite_logprob, prompt_logprobs_json
from pagedserve.entrypoints.openai.protocol import (CompletionChoice, CompletionLogProbs,
                                                    CompletionRequest, CompletionResponse, now)
from pagedserve.entrypoints.openai.serving_common import (SSE_DONE, APIError, check_not_ignored,
                                                          engine_error, error_event, merge_streams,
                                                          OpenAIServing, continuous_usage, request_ids, sse,
                                                          StreamedChoice,
                                                          until_disconnected, usage)
from pagedserve.entrypoints.openai.structured_outputs import resolve_structured_outputs
from pagedserve.logprobs import Logprob
from pagedserve.outputs import CompletionOutput, RequestOutput


@dataclass
class _Prompt:
    text: str | None       # as given, when given as text (echo returns it verbatim)
    token_ids: list[int]


class CompletionChunkEncoder:
    """One request's stream chunks without logprobs, as the exact bytes of
    sse(CompletionResponse(...)) (the test compares them) at a fraction of the cost: the
    fixed parts encoded once, each text by pydantic's own serializer, no model objects."""

    def __init__(self, request_id: str, model: str) -> None:
        self.head = 'data: {"id":' + to_json(request_id).decode() + \
            ',"object":"text_completion","created":'
        self.mid = ',"model":' + to_json(model).decode() + ',"choices":['

    def encode(self, choices: list[tuple[int, str, str | None, int | str | None]]) -> str:
        """choices: (index, text, finish_reason, stop_reason) of each choice in the chunk."""
        parts = [f'{{"index":{index},"text":{to_json(text).decode()},"logprobs":null,'
                 f'"finish_reason":{"null" if finish is None else to_json(finish).decode()},'
                 f'"stop_reason":{"null" if stop is None else to_json(stop).decode()}}}'
                 for index, text, finish, stop in choices]
        return f'{self.head}{now()}{self.mid}{",".join(parts)}],"usage":null}}\n\n'


class OpenAIServingCompletion(OpenAIServing):

    async def _prompts(self, req: CompletionRequest, keep: int | None) -> list[_Prompt]:
        """The prompts as they run: cut to keep ids (truncated_prompt, the engine's own cut)."""
        p = req.prompt
        if isinstance(p, str):
            items: list[Any] = [p]
        elif len(p) == 0:
            raise APIError("prompt must not be empty", param="prompt")
        elif isinstance(p[0], int):
            items = [p]
        else:
            items = list(p)
        self.check_choices(len(items), req.n)
        tok = self.engine.tokenizer
        out = []
        for item in items:
            if isinstance(item, str):
                if not item:
                    raise APIError("prompt must not be empty", param="prompt")
                self.check_text_length(len(item), "prompt")
                ids, cut = await self.engine.run(truncated_prompt, tok, item, keep, side=req.truncation_side,
                                                 add_special_tokens=req.add_special_tokens)
                if not ids:  # (a tokenizer may give no tokens for some text without its BOS)
                    raise APIError("prompt has no tokens", param="prompt")
            else:
                if not item:
                    raise APIError("prompt must not be empty", param="prompt")
                self.check_token_ids(item, "prompt")
                ids, cut = truncated_prompt(None, item, keep, side=req.truncation_side)
            # echo returns a cut text prompt as its kept tokens' text, an uncut one verbatim
            out.append(_Prompt(None if cut or not isinstance(item, str) else item, ids))
        return out

    async def create(self, req: CompletionRequest, raw_request: Any):
        """Returns a CompletionResponse, or an async iterator of SSE lines when streaming."""
        self.audit(req)
        self.check_model(req.model)
        beam = check_beam_search(req, self.engine.max_num_seqs, chat=False)
        if req.best_of is not None and req.best_of < req.n:
            raise APIError(f"best_of must be >= n ({req.n}), got {req.best_of}", param="best_of")
        if req.stream and req.best_of is not None and req.best_of > req.n:
            raise APIError("best_of > n cannot be streamed", param="best_of")
        logprobs_k = self.check_logprobs(req.logprobs, "logprobs")
        prompt_k = self.check_prompt_logprobs(req)
        if prompt_k is None and req.echo and req.logprobs is not None:
            prompt_k = req.logprobs  # the echoed prompt carries its logprobs too (vLLM's default)
        scoring = req.max_tokens == 0  # lm-evaluation-harness's loglikelihood: the prompt's logprobs only
        if scoring and not req.echo:
            raise APIError("max_tokens must be >= 1 unless echo is true (max_tokens 0 scores the prompt)",
                           param="max_tokens")
        # vLLM bounds the cut by the request's max_tokens as given (16 unless set), not the
        # generation config's default that may replace it below.
        keep = self.truncation_size(req.truncate_prompt_tokens, req.max_tokens, "max_tokens")
        prompts = await self._prompts(req, keep)
        # constraint_param: the field that set the grammar, named if it fails at run time
        structured, constraint_param = await resolve_structured_outputs(self.engine, req) or (None, None)
        params = []
        asked = req.max_tokens
        if "max_tokens" not in req.model_fields_set and "max_tokens" in self.default_sampling:
            asked = None  # OpenAI's 16 gives way to the generation config's max_new_tokens, fitted to the context
        for p in prompts:
            max_tokens = self.resolve_max_tokens(len(p.token_ids), 1 if scoring else asked, "prompt",
                                                 num_seqs=req.best_of or req.n)
            if beam:
                sp = beam_search_params(req, max_tokens, self.default_sampling, structured, logprobs_k)
                self.check_kv_capacity(len(p.token_ids), max_tokens, req.n, "prompt")
            else:
                sp = self.sampling_params(req, max_tokens=max_tokens, logprobs=req.logprobs,
                                          best_of=req.best_of, structured_outputs=structured,
                                          prompt_logprobs=prompt_k)
                self.check_kv_capacity(len(p.token_ids), max_tokens, sp.best_of, "prompt")
            params.append(sp)
        request_id, engine_id = request_ids("cmpl", req, raw_request)
        streams: list[RequestStream] = []
        try:
            for i, (p, sp) in enumerate(zip(prompts, params)):
                rid = f"{engine_id}-{i}"
                streams.append(await (self.start_beam(p.token_ids, sp, rid, req) if beam else
                                      self.start(p.token_ids, sp, rid, req.cache_salt, req.priority)))
        except BaseException:
            for s in streams:
                s.close()
            raise
        if req.stream:
            return self._stream(req, request_id, prompts, streams, constraint_param)
        finals = await until_disconnected(raw_request, self._collect(streams, constraint_param))
        return self._response(req, request_id, prompts, finals)

    @staticmethod
    async def _collect(streams: list[RequestStream], constraint_param: str | None = None
                       ) -> list[RequestOutput]:
        finals: list[Any] = [None] * len(streams)
        try:
            async for i, out in merge_streams(streams):
                check_not_ignored(out, "prompt", constraint_param)
                finals[i] = out
        except EngineDeadError as e:
            raise engine_error(e) from None
        return finals

    def _echo_text(self, p: _Prompt) -> str:
        return p.text if p.text is not None else self.engine.tokenizer.decode(p.token_ids)

    def _logprobs(self, token_ids: list[int], lps: list[dict[int, Logprob] | None] | None, k: int,
                  offset: int, as_ids: bool = False) -> tuple[CompletionLogProbs, int]:
        """Tokens named as vLLM names them (token_name: decoded_token where the Logprob has it).
        as_ids (return_tokens_as_token_ids): "token_id:N"; text_offset still counts the tokens'
        text, each token's length being its name's without as_ids. top_logprobs holds up to k + 1
        entries, as OpenAI's completions and vLLM's do: the chosen token first, then the top k
        (the Logprob dict's own order, logprobs.logprob_dict), so a sampled token outside the
        top k is there too."""
        res = CompletionLogProbs()
        for t, lp in zip(token_ids, lps or []):
            chosen = None if lp is None else lp.get(t)  # None: the prompt's first token
            res.tokens.append(self.token_name(t, chosen, as_ids))
            res.token_logprobs.append(None if chosen is None else finite_logprob(chosen.logprob))
            res.top_logprobs.append(None if lp is None else {self.token_name(x, v, as_ids): finite_logprob(v.logprob)
                                                             for x, v in islice(lp.items(), k + 1)})
            res.text_offset.append(offset)
            offset += len(self.token_name(t, chosen))
        return res, offset

    def _with_prompt(self, p: _Prompt, prompt_lps: list | None, k: int,
                     completion: CompletionLogProbs, as_ids: bool = False) -> CompletionLogProbs:
        """echo + logprobs: the prompt's tokens and logprobs (the first one None), then the completion's."""
        if prompt_lps is None:
            raise APIError("prompt logprobs are missing from the engine's output", status=500,
                           type="InternalServerError")
        res, _ = self._logprobs(p.token_ids, prompt_lps, k, 0, as_ids)
        for name in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
            getattr(res, name).extend(getattr(completion, name))
        return res

    def _response(self, req: CompletionRequest, request_id: str, prompts: list[_Prompt],
                  finals: list[RequestOutput]) -> CompletionResponse:
        as_ids = self.tokens_as_ids(req)
        choices = []
        completion_tokens = 0
        for i, (p, out) in enumerate(zip(prompts, finals)):
            prefix = self._echo_text(p) if req.echo else ""
            for c in out.outputs:
                c = _scored_only(c) if req.max_tokens == 0 else c
                completion_tokens += len(c.token_ids)
                lp = None
                if req.logprobs is not None:
                    lp, _ = self._logprobs(c.token_ids, c.logprobs, req.logprobs, len(prefix), as_ids)
                    if req.echo:
                        lp = self._with_prompt(p, out.prompt_logprobs, req.logprobs, lp, as_ids)
                # vLLM's prompt_logprobs, each choice its prompt's (asked for, not implied by echo)
                plp = prompt_logprobs_json(out.prompt_logprobs) if req.prompt_logprobs is not None else None
                ids = req.return_token_ids  # vLLM's: the prompt's ids and the choice's own
                choices.append(CompletionChoice(index=i * req.n + c.index, text=prefix + c.text,
                                                logprobs=lp, finish_reason=c.finish_reason,
                                                stop_reason=c.stop_reason, prompt_logprobs=plp,
                                                prompt_token_ids=p.token_ids if ids else None,
                                                token_ids=list(c.token_ids) if ids else None))
        choices.sort(key=lambda ch: ch.index)
        prompt_tokens = sum(len(p.token_ids) for p in prompts)
        return CompletionResponse(id=request_id, model=self.served_model_name, choices=choices,
                                  usage=usage(prompt_tokens, completion_tokens, self.cached_tokens(finals)))

    async def _stream(self, req: CompletionRequest, request_id: str, prompts: list[_Prompt],
                      streams: list[RequestStream], constraint_param: str | None = None
                      ) -> AsyncIterator[str]:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        each_usage = continuous_usage(req)
        as_ids = self.tokens_as_ids(req)
        states: dict[tuple[int, int], StreamedChoice] = {}
        model = self.served_model_name
        # Without logprobs or token ids (the common case) chunks are encoded directly: same bytes.
        plain = req.logprobs is None and not req.return_token_ids and not each_usage
        fast = CompletionChunkEncoder(request_id, model) if plain else None
        prompt_lps: dict[int, list] = {}  # prompt_logprobs arrive in one output per prompt (DELTA)
        last: dict[int, Any] = {}  # each prompt's latest output (its metrics: cached tokens)
        try:
            async for i, out in merge_streams(streams):
                last[i] = out
                check_not_ignored(out, "prompt", constraint_param)
                if out.prompt_logprobs is not None:
                    prompt_lps[i] = out.prompt_logprobs
                choices = []
                for c in out.outputs:
                    c = _scored_only(c) if req.max_tokens == 0 else c
                    st = states.get((i, c.index))
                    first = st is None
                    if first:
                        st = states[(i, c.index)] = StreamedChoice()
                        prefix = self._echo_text(prompts[i]) if req.echo else ""
                    else:
                        prefix = ""
                    # DELTA outputs: each choice carries only its new tokens, text and logprobs.
                    if not st.take(c, prefix):
                        continue
                    if fast is not None:
                        choices.append((i * req.n + c.index, prefix + c.text, c.finish_reason, c.stop_reason))
                        continue
                    lp = None
                    if req.logprobs is not None:
                        lp, st.text_offset = self._logprobs(c.token_ids, c.logprobs, req.logprobs,
                                                            st.text_offset + len(prefix), as_ids)
                        if prefix:
                            lp = self._with_prompt(prompts[i], prompt_lps.get(i), req.logprobs, lp, as_ids)
                    # return_token_ids: the prompt's ids in each choice's first chunk (vLLM's)
                    ids = req.return_token_ids
                    choices.append((CompletionChoice(index=i * req.n + c.index, text=prefix + c.text,
                                                     logprobs=lp, finish_reason=c.finish_reason,
                                                     stop_reason=c.stop_reason,
                                                     prompt_token_ids=prompts[i].token_ids if ids and first else None,
                                                     token_ids=list(c.token_ids) if ids else None),
                                    usage(len(prompts[i].token_ids), st.num_tokens) if each_usage else None))
                for choice in choices:  # one a chunk, as OpenAI's and vLLM's streams with n > 1
                    yield fast.encode([choice]) if fast is not None else \
                        sse(CompletionResponse(id=request_id, model=model, choices=[choice[0]], usage=choice[1]))
            if include_usage:
                prompt_tokens = sum(len(p.token_ids) for p in prompts)
                completion_tokens = sum(st.num_tokens for st in states.values())
                yield sse(CompletionResponse(id=request_id, model=model, choices=[],
                                             usage=usage(prompt_tokens, completion_tokens,
                                                         self.cached_tokens(last.values()))))
        except APIError as e:
            yield error_event(e)
        except EngineDeadError as e:
            yield error_event(engine_error(e))
        finally:
            for s in streams:
                s.close()
        yield SSE_DONE


def _scored_only(c: CompletionOutput) -> CompletionOutput:
    """max_tokens 0 runs one token (the prompt's logprobs need a step) and reports none of it."""
    return dataclasses.replace(c, text="", token_ids=[], logprobs=[] if c.logprobs is not None else None,
                               finish_reason="length" if c.finish_reason is not None else None, stop_reason=None)
