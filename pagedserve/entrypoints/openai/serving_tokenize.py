"""POST /tokenize and /detokenize, GET /version: vLLM's extra endpoints, in its shapes.

/tokenize takes a completion's `prompt` (special tokens added unless add_special_tokens=false) or
a chat's `messages` (rendered exactly as /v1/chat/completions renders them: the same template,
tools and chat_template_kwargs, message text never a control token) and answers
{count, max_model_len, tokens, token_strs}. /detokenize answers {prompt} for `tokens`.
"""
from __future__ import annotations

from typing import Annotated, Any, ClassVar, Optional

from pydantic import Field

from pagedserve.entrypoints.openai.protocol import (ChatMessage, ChatTool, FieldAudit, OpenAIModel,
                                                    TokenId, MAX_TOOLS)
from pagedserve.entrypoints.openai.serving_common import APIError, OpenAIServing
from pagedserve.entrypoints.openai.tools import rendered_tools

MAX_DETOKENIZE_TOKENS = 1 << 20


class TokenizeRequest(FieldAudit):
    """A completion's `prompt` or a chat's `messages` (exactly one); the rest as vLLM's two shapes.
    vLLM's fields not honoured here are a 400 unless at their no-op value; unknown keys are logged."""
    UNSUPPORTED: ClassVar[dict[str, tuple[tuple, str]]] = {
        "chat_template": ((), "a per-request chat_template is not supported: the server's template "
                              "(the model's, or --chat-template) renders every request"),
        "mm_processor_kwargs": (({},), "mm_processor_kwargs is not supported (text models only)"),
        "media_io_kwargs": (({},), "media_io_kwargs is not supported (text models only)"),
    }
    chat_template: Optional[str] = None
    mm_processor_kwargs: Optional[dict[str, Any]] = None
    media_io_kwargs: Optional[dict[str, Any]] = None
    model: Optional[str] = None
    prompt: Optional[str] = None
    messages: Optional[Annotated[list[ChatMessage], Field(min_length=1)]] = None
    # None: true for a prompt, false for messages (their template places the special tokens;
    # true adds the tokenizer's own too, as chat completions' add_special_tokens does).
    add_special_tokens: Optional[bool] = None
    return_token_strs: Optional[bool] = False
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    tools: Optional[list[ChatTool]] = Field(None, max_length=MAX_TOOLS)
    chat_template_kwargs: Optional[dict[str, Any]] = None


class TokenizeResponse(OpenAIModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: Optional[list[str]] = None


class DetokenizeRequest(FieldAudit):
    model: Optional[str] = None
    tokens: Annotated[list[TokenId], Field(max_length=MAX_DETOKENIZE_TOKENS)]


class DetokenizeResponse(OpenAIModel):
    prompt: str


class OpenAIServingTokenization(OpenAIServing):

    def __init__(self, engine: Any, served_model_name: str, chat: Any) -> None:
        """chat: the server's OpenAIServingChat, whose checks and rendering messages go through."""
        super().__init__(engine, served_model_name)
        self.chat = chat

    def _tokenizer(self, param: str) -> Any:
        tok = self.engine.tokenizer
        if tok is None:
            raise APIError("this server has no tokenizer (--skip-tokenizer-init)", param=param)
        return tok

    async def tokenize(self, req: TokenizeRequest) -> TokenizeResponse:
        self.audit(req)
        self.check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise APIError("give either prompt or messages", param="prompt" if req.prompt is None else "messages")
        if req.messages is not None:
            tok = self._tokenizer("messages")
            self.chat.check_messages(req)
            ids = await self.engine.run(self.chat._render, req, rendered_tools(req))
        else:
            for name in ("tools", "chat_template_kwargs", "continue_final_message"):
                if getattr(req, name):
                    raise APIError(f"{name} applies to messages, not to a prompt", param=name)
            if not req.add_generation_prompt:  # (its default, true, is no request of anything)
                raise APIError("add_generation_prompt applies to messages, not to a prompt",
                               param="add_generation_prompt")
            tok = self._tokenizer("prompt")
            self.check_text_length(len(req.prompt), "prompt")
            special = req.add_special_tokens is not False
            ids = await self.engine.run(lambda: list(tok(req.prompt, add_special_tokens=special).input_ids))
        strs = tok.convert_ids_to_tokens(ids) if req.return_token_strs else None
        return TokenizeResponse(count=len(ids), max_model_len=self.engine.max_model_len, tokens=ids, token_strs=strs)

    async def detokenize(self, req: DetokenizeRequest) -> DetokenizeResponse:
        self.audit(req)
        self.check_model(req.model)
        tok = self._tokenizer("tokens")
        self.check_token_ids(req.tokens, "tokens")
        return DetokenizeResponse(prompt=await self.engine.run(tok.decode, req.tokens))
