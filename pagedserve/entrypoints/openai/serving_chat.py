"""POST /v1/chat/completions: messages (and tools) -> the tokenizer's chat template -> one prompt;
the output text -> a message (content, reasoning_content, tool_calls) through message_stream."""
from __future__ import annotations

from typing import Any, AsyncIterator

from pagedserve.engine.async_engine import EngineDeadError
from pagedserve.engine.input_processor import truncated_prompt
from pagedserve.engine.request_stream import RequestStream
from pagedserve.entrypoints.openai.beam_search import beam_search_params, check_beam_search
from pagedserve.entrypoints.openai.chat_render import render_request_ids, render_request_text
from pagedserve.entrypoints.openai.logprob_names import finite_logprob, prompt_logprobs_json, token_bytes
from pagedserve.entrypoints.openai.protocol import (ChatChoice, ChatCompletionChunk,
                                                    ChatCompletionRequest, ChatCompletionResponse,
                                                    ChatLogprobs, ChatResponseMessage,
                                                    ChatStreamChoice, DeltaMessage, TokenLogprob)
from pagedserve.entrypoints.openai.serving_common import (SSE_DONE, APIError, check_not_ignored,
                                                          engine_error, error_event, OpenAIServing,
                                                          continuous_usage, request_ids, sse, StreamedChoice,
                                                          until_disconnected, usage)
from pagedserve.entrypoints.openai.message_stream import (MessageParser, MessageStreamer,
                                                          finish_reason)
from pagedserve.entrypoints.openai.reasoning_parsers import ReasoningParser
from pagedserve.entrypoints.openai.structured_outputs import resolve_structured_outputs
from pagedserve.entrypoints.openai.tool_parsers import ToolParser
from pagedserve.entrypoints.openai.tools import check_history, plan_tools
from pagedserve.logprobs import Logprob
from pagedserve.outputs import RequestOutput


class OpenAIServingChat(OpenAIServing):

    def __init__(self, engine: Any, served_model_name: str, default_sampling: dict | None = None,
                 tool_parser: type[ToolParser] | None = None,
                 reasoning_parser: type[ReasoningParser] | None = None, content_format: str = "auto") -> None:
        """tool_parser: the --tool-call-parser when --enable-auto-tool-choice is on (else
        tool_choice=auto is a 400); reasoning_parser: the --reasoning-parser, if any;
        content_format: --chat-template-content-format (chat_tokens.content_format)."""
        super().__init__(engine, served_model_name, default_sampling)
        self.auto_tool_parser = tool_parser
        self.reasoning_parser = reasoning_parser
        self.content_format = content_format

    def _render(self, req: ChatCompletionRequest, tools: list[dict] | None = None) -> list[int]:
        """Runs on the API process's tokenizer thread (AsyncLLMEngine.run). The rendering itself
        is chat_render's, which the DP router's routing key shares."""
        return render_request_ids(self.engine.tokenizer, req, self.content_format, tools)

    def check_messages(self, req: Any) -> None:
        """The conversation's own checks (chat completions and /tokenize): a 400 naming the field."""
        if req.continue_final_message and req.add_generation_prompt:
            raise APIError("continue_final_message needs add_generation_prompt=false",
                           param="continue_final_message")
        check_history(req.messages)
        self.check_text_length(sum(len(m.content) if isinstance(m.content, str) else
                                   sum(len(p.text) + 1 for p in m.content or []) for m in req.messages),
                               "messages")

    def _top_k(self, req: ChatCompletionRequest) -> int:
        """top_logprobs as a count (checked in create): vLLM's -1 is the whole vocabulary."""
        return self.engine.vocab_size if req.top_logprobs == -1 else (req.top_logprobs or 0)

    async def create(self, req: ChatCompletionRequest, raw_request: Any):
        self.audit(req)
        self.check_model(req.model)
        beam = check_beam_search(req, self.engine.max_num_seqs, chat=True)
        if req.top_logprobs is not None and not req.logprobs:
            raise APIError("top_logprobs needs logprobs=true", param="top_logprobs")
        self.check_logprobs(req.top_logprobs, "top_logprobs")
        prompt_k = self.check_prompt_logprobs(req)
        self.check_choices(1, req.n)
        self.check_messages(req)
        # tools' schema checks off the loop; without tools the plan is a look at two fields
        plan = (await self.engine.run(plan_tools, req, self.auto_tool_parser) if req.tools
                else plan_tools(req, self.auto_tool_parser))
        # constraint_param: the field that set the grammar, named if it fails at run time
        structured, constraint_param = (await resolve_structured_outputs(self.engine, req, plan.constraint)
                                        or (None, None))
        # A grammar constrains the output from its first token: no <think> block to split off.
        reasoning = self.reasoning_parser() if self.reasoning_parser and structured is None else None
        parser = MessageParser(reasoning, plan.parser, plan.parallel)
        # include_reasoning=false: the reasoning is withheld, and with it what would show it
        # (logprobs, token ids), as vLLM withholds them
        hide = not req.include_reasoning and reasoning is not None
        if req.max_completion_tokens is not None:
            max_tokens, tokens_param = req.max_completion_tokens, "max_completion_tokens"
        else:
            max_tokens, tokens_param = req.max_tokens, "max_tokens"
        keep = self.truncation_size(req.truncate_prompt_tokens, max_tokens, tokens_param)
        # The rendered ids keep their last `keep` (vLLM tokenizes the rendered text without added
        # special tokens, its BOS being the template's text, and cuts that on the left).
        prompt_ids, _ = truncated_prompt(None, await self.engine.run(self._render, req, plan.tools), keep,
                                         side=req.truncation_side)
        # vLLM's return_prompt_text: the template's text (rendered once more, only when asked)
        prompt_text = (await self.engine.run(render_request_text, self.engine.tokenizer, req, self.content_format,
                                             plan.tools) if req.return_prompt_text else None)
        max_tokens = self.resolve_max_tokens(len(prompt_ids), max_tokens, "messages", tokens_param,
                                             num_seqs=req.n)
        k = self._top_k(req) if req.logprobs else None
        keep_special = plan.parser is not None and plan.parser.keeps_special_tokens
        request_id, engine_id = request_ids("chatcmpl", req, raw_request)
        role, echo = self._role_and_echo(req)
        if beam:
            bp = beam_search_params(req, max_tokens, self.default_sampling, structured, k)
            self.check_kv_capacity(len(prompt_ids), max_tokens, req.n, "messages", tokens_param)
            stream = await self.start_beam(prompt_ids, bp, engine_id, req, False if keep_special else None)
        else:
            params = self.sampling_params(req, max_tokens=max_tokens, logprobs=k,
                                          structured_outputs=structured,
                                          skip_special_tokens=False if keep_special else None,
                                          prompt_logprobs=prompt_k)
            self.check_kv_capacity(len(prompt_ids), max_tokens, params.best_of, "messages", tokens_param)
            stream = await self.start(prompt_ids, params, engine_id, req.cache_salt, req.priority)
        if req.stream:
            return self._stream(req, request_id, prompt_ids, stream, parser, constraint_param, hide, role, echo,
                                prompt_text)
        final = await until_disconnected(raw_request, self._collect(stream, constraint_param))
        response = self._response(req, request_id, final, parser, hide, role, echo)
        response.prompt_text = prompt_text
        return response

    @staticmethod
    def _role_and_echo(req: ChatCompletionRequest) -> tuple[str, str]:
        """The answer's role (assistant; without a generation prompt, the last message's, as in
        vLLM) and what echo puts before its content: the last message's text where its role is
        the answer's ("" otherwise, or without echo)."""
        last = req.messages[-1]
        role = "assistant" if req.add_generation_prompt else last.role
        if not req.echo or last.role != role or not last.content:
            return role, ""
        content = last.content
        return role, content if isinstance(content, str) else "\n".join(p.text for p in content)

    @staticmethod
    async def _collect(stream: RequestStream, constraint_param: str | None = None) -> RequestOutput:
        final = None
        try:
            async for out in stream:
                check_not_ignored(out, "messages", constraint_param)
                final = out
        except EngineDeadError as e:
            raise engine_error(e) from None
        finally:
            stream.close()
        return final

    def _logprobs(self, token_ids: list[int], lps: list[dict[int, Logprob]] | None,
                  k: int, as_ids: bool = False) -> ChatLogprobs:
        content = []
        for t, lp in zip(token_ids, lps or []):
            chosen = lp.get(t)
            s = self.token_name(t, chosen, as_ids)
            content.append(TokenLogprob(token=s, logprob=finite_logprob(float("-inf") if chosen is None
                                                                        else chosen.logprob),
                                        bytes=token_bytes(s),
                                        top_logprobs=self.top_logprobs_chat(lp, k, as_ids)))
        return ChatLogprobs(content=content)

    def _response(self, req: ChatCompletionRequest, request_id: str, out: RequestOutput,
                  parser: MessageParser, hide: bool = False, role: str = "assistant",
                  echo: str = "") -> ChatCompletionResponse:
        choices = []
        ids = req.return_token_ids and not hide
        for c in out.outputs:
            lp = self._logprobs(c.token_ids, c.logprobs, self._top_k(req),
                                    self.tokens_as_ids(req)) if req.logprobs and not hide else None
            message = parser.message(c.text) if parser.active else ChatResponseMessage(content=c.text)
            message.role = role
            if hide:
                message.reasoning_content = None
            if echo:
                message.content = echo + (message.content or "")
            choices.append(ChatChoice(index=c.index, message=message, logprobs=lp,
                                      finish_reason=finish_reason(c.finish_reason,
                                                                  bool(message.tool_calls)),
                                      stop_reason=c.stop_reason, token_ids=list(c.token_ids) if ids else None))
        choices.sort(key=lambda ch: ch.index)
        completion_tokens = sum(len(c.token_ids) for c in out.outputs)
        return ChatCompletionResponse(id=request_id, model=self.served_model_name, choices=choices,
                                      usage=usage(len(out.prompt_token_ids), completion_tokens,
                                                  self.cached_tokens([out])),
                                      prompt_logprobs=prompt_logprobs_json(out.prompt_logprobs)
                                      if req.prompt_logprobs is not None else None,
                                      prompt_token_ids=list(out.prompt_token_ids) if req.return_token_ids else None)

    async def _stream(self, req: ChatCompletionRequest, request_id: str, prompt_ids: list[int],
                      stream: RequestStream, parser: MessageParser,
                      constraint_param: str | None = None, hide: bool = False, role: str = "assistant",
                      echo: str = "", prompt_text: str | None = None) -> AsyncIterator[str]:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        model, prompt_len = self.served_model_name, len(prompt_ids)
        ids = req.return_token_ids and not hide
        each_usage = continuous_usage(req)
        states: dict[int, StreamedChoice] = {}
        streamers: dict[int, MessageStreamer] = {}
        try:
            # The role comes first, on its own, as OpenAI sends it. Every chunk carries one choice,
            # as OpenAI's and vLLM's do with n > 1 (a client may read choices[0] and its index).
            for i in range(req.n):
                yield sse(ChatCompletionChunk(id=request_id, model=model, choices=[
                    ChatStreamChoice(index=i, delta=DeltaMessage(role=role, content=""))],
                    prompt_token_ids=prompt_ids if req.return_token_ids else None, prompt_text=prompt_text,
                    usage=usage(prompt_len, 0) if each_usage else None))
            for i in range(req.n if echo else 0):  # vLLM's: the echoed text, a chunk per choice
                yield sse(ChatCompletionChunk(id=request_id, model=model, choices=[
                    ChatStreamChoice(index=i, delta=DeltaMessage(content=echo))],
                    usage=usage(prompt_len, 0) if each_usage else None))
            last = None
            async for out in stream:
                last = out
                check_not_ignored(out, "messages", constraint_param)
                choices = []
                # DELTA outputs: each choice carries only its new tokens, text and logprobs.
                for c in out.outputs:
                    if not states.setdefault(c.index, StreamedChoice()).take(c):
                        continue
                    lp = None
                    if req.logprobs and not hide:
                        lp = self._logprobs(c.token_ids, c.logprobs, self._top_k(req),
                                    self.tokens_as_ids(req))
                    delta, finish = DeltaMessage(content=c.text), c.finish_reason
                    if parser.active:
                        st = streamers.setdefault(c.index, MessageStreamer(parser))
                        delta = st.feed(c.text, final=finish is not None)
                        if hide and delta is not None:
                            delta.reasoning_content = None
                            if delta.content is None and delta.tool_calls is None:
                                delta = None
                        # held back (may be the start of a tag) or withheld: no chunk, unless
                        # it carries logprobs or token ids (every token is in one, as in vLLM)
                        if delta is None and finish is None and lp is None and not ids:
                            continue
                        delta = delta or DeltaMessage()
                        finish = finish_reason(finish, st.called_tools)
                    choices.append(ChatStreamChoice(index=c.index, delta=delta, logprobs=lp,
                                                    finish_reason=finish, stop_reason=c.stop_reason,
                                                    token_ids=list(c.token_ids) if ids else None))
                for choice in choices:
                    u = usage(prompt_len, states[choice.index].num_tokens) if each_usage else None
                    yield sse(ChatCompletionChunk(id=request_id, model=model, choices=[choice], usage=u))
            if include_usage:
                completion_tokens = sum(st.num_tokens for st in states.values())
                yield sse(ChatCompletionChunk(id=request_id, model=model, choices=[],
                                              usage=usage(prompt_len, completion_tokens,
                                                          self.cached_tokens([last] if last else []))))
        except APIError as e:
            yield error_event(e)
        except EngineDeadError as e:
            yield error_event(engine_error(e))
        finally:
            stream.close()
        yield SSE_DONE
