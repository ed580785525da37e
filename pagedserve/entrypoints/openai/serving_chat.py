"""POST /v1/chat/completions: messages -> the tokenizer's chat template -> one prompt."""
from __future__ import annotations

from typing import Any, AsyncIterator

from pagedserve.engine.async_engine import EngineDeadError, RequestStream
from pagedserve.entrypoints.openai.chat_tokens import SpecialTokenInContent, render_chat_ids
from pagedserve.entrypoints.openai.protocol import (ChatChoice, ChatCompletionChunk,
                                                    ChatCompletionRequest, ChatCompletionResponse,
                                                    ChatLogprobs, ChatResponseMessage,
                                                    ChatStreamChoice, DeltaMessage, TokenLogprob,
                                                    random_id)
from pagedserve.entrypoints.openai.serving_common import (SSE_DONE, APIError, check_not_ignored,
                                                          engine_error, error_event, finite_logprob,
                                                          OpenAIServing, sse, StreamedChoice,
                                                          until_disconnected, usage)
from pagedserve.outputs import RequestOutput


class OpenAIServingChat(OpenAIServing):

    def _render(self, req: ChatCompletionRequest) -> list[int]:
        """Runs on the API process's tokenizer thread (AsyncLLMEngine.run)."""
        tok = self.engine.tokenizer
        if not getattr(tok, "chat_template", None):
            raise APIError("this model's tokenizer has no chat template; use /v1/completions",
                           param="messages")
        messages = []
        for m in req.messages:
            content = m.content
            if isinstance(content, list):
                content = "\n".join(part.text for part in content)
            msg = {"role": m.role, "content": content or ""}
            if m.name is not None:
                msg["name"] = m.name
            messages.append(msg)
        try:
            return render_chat_ids(tok, messages, req.add_generation_prompt)
        except SpecialTokenInContent as e:
            raise APIError(str(e), param=str(e).split(":", 1)[0]) from None
        except Exception as e:  # jinja raises for conversations its template refuses
            raise APIError(f"messages could not be rendered by the chat template: {e}",
                           param="messages") from None

    async def create(self, req: ChatCompletionRequest, raw_request: Any):
        self.check_model(req.model)
        if req.top_logprobs is not None and not req.logprobs:
            raise APIError("top_logprobs needs logprobs=true", param="top_logprobs")
        self.check_choices(1, req.n)
        self.check_text_length(sum(len(m.content) if isinstance(m.content, str) else
                                   sum(len(p.text) + 1 for p in m.content or []) for m in req.messages),
                               "messages")
        prompt_ids = await self.engine.run(self._render, req)
        if req.max_completion_tokens is not None:
            max_tokens, tokens_param = req.max_completion_tokens, "max_completion_tokens"
        else:
            max_tokens, tokens_param = req.max_tokens, "max_tokens"
        max_tokens = self.resolve_max_tokens(len(prompt_ids), max_tokens, "messages", tokens_param,
                                             num_seqs=req.n)
        k = (req.top_logprobs or 0) if req.logprobs else None
        params = self.sampling_params(req, max_tokens=max_tokens, logprobs=k)
        self.check_kv_capacity(len(prompt_ids), max_tokens, params.best_of, "messages", tokens_param)
        request_id = random_id("chatcmpl")
        stream = await self.start(prompt_ids, params, request_id)
        if req.stream:
            return self._stream(req, request_id, len(prompt_ids), stream)
        final = await until_disconnected(raw_request, self._collect(stream))
        return self._response(req, request_id, final)

    @staticmethod
    async def _collect(stream: RequestStream) -> RequestOutput:
        final = None
        try:
            async for out in stream:
                check_not_ignored(out, "messages")
                final = out
        except EngineDeadError as e:
            raise engine_error(e) from None
        finally:
            stream.close()
        return final

    def _logprobs(self, token_ids: list[int], lps: list[dict[int, float]] | None,
                  k: int) -> ChatLogprobs:
        content = []
        for t, lp in zip(token_ids, lps or []):
            s = self.token_str(t)
            content.append(TokenLogprob(token=s, logprob=finite_logprob(lp.get(t, float("-inf"))),
                                        bytes=list(s.encode("utf-8")),
                                        top_logprobs=self.top_logprobs_chat(lp, k)))
        return ChatLogprobs(content=content)

    def _response(self, req: ChatCompletionRequest, request_id: str,
                  out: RequestOutput) -> ChatCompletionResponse:
        choices = []
        for c in out.outputs:
            lp = self._logprobs(c.token_ids, c.logprobs, req.top_logprobs or 0) if req.logprobs else None
            choices.append(ChatChoice(index=c.index, message=ChatResponseMessage(content=c.text),
                                      logprobs=lp, finish_reason=c.finish_reason))
        choices.sort(key=lambda ch: ch.index)
        completion_tokens = sum(len(c.token_ids) for c in out.outputs)
        return ChatCompletionResponse(id=request_id, model=self.served_model_name, choices=choices,
                                      usage=usage(len(out.prompt_token_ids), completion_tokens))

    async def _stream(self, req: ChatCompletionRequest, request_id: str, prompt_len: int,
                      stream: RequestStream) -> AsyncIterator[str]:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        model = self.served_model_name
        states: dict[int, StreamedChoice] = {}
        try:
            # The role comes first, on its own, as OpenAI sends it.
            yield sse(ChatCompletionChunk(id=request_id, model=model, choices=[
                ChatStreamChoice(index=i, delta=DeltaMessage(role="assistant", content=""))
                for i in range(req.n)]))
            async for out in stream:
                check_not_ignored(out, "messages")
                choices = []
                # DELTA outputs: each choice carries only its new tokens, text and logprobs.
                for c in out.outputs:
                    if not states.setdefault(c.index, StreamedChoice()).take(c):
                        continue
                    lp = None
                    if req.logprobs:
                        lp = self._logprobs(c.token_ids, c.logprobs, req.top_logprobs or 0)
                    choices.append(ChatStreamChoice(index=c.index, delta=DeltaMessage(content=c.text),
                                                    logprobs=lp, finish_reason=c.finish_reason))
                if choices:
                    yield sse(ChatCompletionChunk(id=request_id, model=model, choices=choices))
            if include_usage:
                completion_tokens = sum(st.num_tokens for st in states.values())
                yield sse(ChatCompletionChunk(id=request_id, model=model, choices=[],
                                              usage=usage(prompt_len, completion_tokens)))
        except APIError as e:
            yield error_event(e)
        except EngineDeadError as e:
            yield error_event(engine_error(e))
        finally:
            stream.close()
        yield SSE_DONE
