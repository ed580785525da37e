"""Pydantic models of the OpenAI API (completions, chat, models, errors) plus vLLM's extras.

Bounds live here, in the schema, so that /openapi.json tells clients (and schemathesis)
what is valid and a violation becomes a 400 that names the field. Cross-field limits
(prompt + max_tokens <= max_model_len, ...) are checked by the serving layer.
"""
from __future__ import annotations

import re
import time
import uuid
from typing import Annotated, Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_serializer

from pagedserve.sampling_params import MAX_N

MAX_LOGPROBS = 20
MAX_STOP = 16
MAX_SEED = 2**63 - 1
MAX_TOKEN_ID = 2**31 - 1


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


class OpenAIModel(BaseModel):
    model_config = ConfigDict(extra="ignore", ser_json_inf_nan="null")


_LONE_SURROGATE = re.compile("[\ud800-\udfff]")


def _check_text(value: Any) -> None:
    """Raise ValueError for a string (anywhere in lists and dict keys/values) holding a lone
    UTF-16 surrogate: JSON can escape one ("\\ud800", a JavaScript string cut inside an emoji),
    but it is no Unicode text, so no tokenizer or UTF-8 encoder downstream can take it."""
    if isinstance(value, str):
        m = _LONE_SURROGATE.search(value)
        if m:
            raise ValueError(f"contains a lone UTF-16 surrogate (U+{ord(m.group()):04X}) at "
                             f"character {m.start()}, which is not valid Unicode text")
    elif isinstance(value, list):
        # Runs after type validation, so a list is all of one type: token ids need no look.
        if value and not isinstance(value[0], (int, float)):
            for v in value:
                _check_text(v)
    elif isinstance(value, dict):
        for k, v in value.items():
            _check_text(k)
            _check_text(v)


class Request(OpenAIModel):
    """Base of every request body: also refuses lone surrogates in any of its text fields.

    Strict, as OpenAI's schema is: no "16" for an integer, "yes" or 1 for a boolean, true for a
    token id (a 400 naming the field); a float field still takes a JSON integer."""
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False, strict=True)

    @field_validator("*", mode="after")
    @classmethod
    def _valid_unicode(cls, value: Any) -> Any:
        _check_text(value)
        return value


# ---- errors --------------------------------------------------------------------------------

class ErrorInfo(OpenAIModel):
    message: str
    type: str
    param: Optional[str] = None
    code: Optional[Union[str, int]] = None


class ErrorResponse(OpenAIModel):
    error: ErrorInfo


# ---- shared request pieces ------------------------------------------------------------------

class StreamOptions(Request):
    include_usage: Optional[bool] = False
    continuous_usage_stats: Optional[bool] = False


Stop = Union[Annotated[str, Field(min_length=1)],
             Annotated[list[Annotated[str, Field(min_length=1)]], Field(max_length=MAX_STOP)], None]
TokenId = Annotated[int, Field(ge=0, le=MAX_TOKEN_ID)]


class SamplingFields(Request):
    """Fields shared by completions and chat: OpenAI's, then vLLM's extras."""
    model: Optional[str] = None
    n: int = Field(1, ge=1, le=MAX_N)
    temperature: Optional[float] = Field(None, ge=0.0, le=100.0)
    top_p: Optional[float] = Field(None, gt=0.0, le=1.0)
    stop: Stop = None
    stream: Optional[bool] = False
    stream_options: Optional[StreamOptions] = None
    seed: Optional[int] = Field(None, ge=0, le=MAX_SEED)
    presence_penalty: Optional[float] = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: Optional[float] = Field(0.0, ge=-2.0, le=2.0)
    user: Optional[str] = None
    # vLLM extras
    top_k: Optional[int] = Field(None, ge=-1, le=MAX_TOKEN_ID)
    min_p: Optional[float] = Field(None, ge=0.0, le=1.0)
    repetition_penalty: Optional[float] = Field(None, gt=0.0, le=2.0)
    min_tokens: int = Field(0, ge=0, le=MAX_TOKEN_ID)
    ignore_eos: bool = False
    stop_token_ids: Optional[Annotated[list[TokenId], Field(max_length=MAX_STOP)]] = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False


# ---- completions ----------------------------------------------------------------------------

PromptType = Union[
    str,
    list[TokenId],
    list[str],
    list[list[TokenId]],
]


class CompletionRequest(SamplingFields):
    prompt: PromptType
    max_tokens: Optional[int] = Field(16, ge=1, le=MAX_TOKEN_ID)
    best_of: Optional[int] = Field(None, ge=1, le=MAX_N)
    logprobs: Optional[int] = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: Optional[bool] = False
    suffix: Optional[str] = None
    logit_bias: Optional[dict[str, float]] = None


class CompletionLogProbs(OpenAIModel):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[Optional[float]] = Field(default_factory=list)
    top_logprobs: list[Optional[dict[str, float]]] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(OpenAIModel):
    index: int
    text: str
    logprobs: Optional[CompletionLogProbs] = None
    finish_reason: Optional[str] = None


class Usage(OpenAIModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


class CompletionResponse(OpenAIModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=now)
    model: str
    choices: list[CompletionChoice]
    usage: Optional[Usage] = None


# ---- chat -----------------------------------------------------------------------------------

class TextPart(Request):
    type: Literal["text"]
    text: str


class ChatMessage(Request):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Union[str, list[TextPart], None] = None
    name: Optional[str] = None


class ChatCompletionRequest(SamplingFields):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_tokens: Optional[int] = Field(None, ge=1, le=MAX_TOKEN_ID)
    max_completion_tokens: Optional[int] = Field(None, ge=1, le=MAX_TOKEN_ID)
    logprobs: Optional[bool] = False
    top_logprobs: Optional[int] = Field(None, ge=0, le=MAX_LOGPROBS)
    logit_bias: Optional[dict[str, float]] = None
    add_generation_prompt: bool = True


class TopLogprob(OpenAIModel):
    token: str
    logprob: float
    bytes: Optional[list[int]] = None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(OpenAIModel):
    content: Optional[list[TokenLogprob]] = None


class ChatResponseMessage(OpenAIModel):
    role: Literal["assistant"] = "assistant"
    content: Optional[str] = None


class ChatChoice(OpenAIModel):
    index: int
    message: ChatResponseMessage
    logprobs: Optional[ChatLogprobs] = None
    finish_reason: Optional[str] = None


class ChatCompletionResponse(OpenAIModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=now)
    model: str
    choices: list[ChatChoice]
    usage: Optional[Usage] = None


class DeltaMessage(OpenAIModel):
    role: Optional[str] = None
    content: Optional[str] = None

    @model_serializer(mode="wrap")
    def _drop_unset(self, handler):
        """OpenAI's deltas carry only the keys that changed."""
        return {k: v for k, v in handler(self).items() if v is not None}


class ChatStreamChoice(OpenAIModel):
    index: int
    delta: DeltaMessage
    logprobs: Optional[ChatLogprobs] = None
    finish_reason: Optional[str] = None


class ChatCompletionChunk(OpenAIModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=now)
    model: str
    choices: list[ChatStreamChoice]
    usage: Optional[Usage] = None


# ---- models ---------------------------------------------------------------------------------

class ModelCard(OpenAIModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=now)
    owned_by: str = "pagedserve"
    max_model_len: Optional[int] = None
    # Not OpenAI's: lets clients (`pagedserve bench serve`) send valid token-id prompts.
    vocab_size: Optional[int] = None


class ModelList(OpenAIModel):
    object: Literal["list"] = "list"
    data: list[ModelCard] = Field(default_factory=list)


def dump(model: BaseModel, **kw: Any) -> str:
    """JSON of a response model, leaving out nothing (OpenAI sends explicit nulls)."""
    return model.model_dump_json(**kw)
