"""Pydantic models of the OpenAI API (completions, chat, models, errors) plus vLLM's extras.

Bounds live here, in the schema, so that /openapi.json tells clients (and schemathesis)
what is valid and a violation becomes a 400 that names the field. Cross-field limits
(prompt + max_tokens <= max_model_len, ...) are checked by the serving layer. The base
classes (strict requests, the field audit) are in protocol_base.py.
"""
from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, model_serializer

from pagedserve.entrypoints.openai.protocol_base import (  # noqa: F401 (re-exported)
    MAX_SEED, MAX_STOP, MAX_TOKEN_ID, ErrorInfo, ErrorResponse, FieldAudit, OpenAIModel, Request,
    Stop, StreamOptions, TokenId, now, random_id)
from pagedserve.sampling_params import MAX_N, MIN_REPETITION_PENALTY

MAX_TOOLS = 128  # OpenAI's limit on `tools`
FUNCTION_NAME = r"^[a-zA-Z0-9_.\-]{1,64}$"

# ---- structured outputs ---------------------------------------------------------------------

class JSONSchemaFormat(Request):
    """response_format.json_schema: OpenAI's {name, description, schema, strict}."""
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False, populate_by_name=True)
    name: str = Field(min_length=1, max_length=64)
    description: Optional[str] = None
    json_schema: Optional[dict[str, Any]] = Field(None, alias="schema")
    strict: Optional[bool] = None


class ResponseFormat(Request):
    """OpenAI's response_format; structural_tag is vLLM's (xgrammar's structural-tag format:
    `structures` + `triggers`, or `format`)."""
    type: Literal["text", "json_object", "json_schema", "structural_tag"]
    json_schema: Optional[JSONSchemaFormat] = None
    structures: Optional[list[dict[str, Any]]] = None
    triggers: Optional[list[str]] = None
    format: Optional[dict[str, Any]] = None


class StructuredOutputsRequest(Request):
    """vLLM's `structured_outputs` request field: exactly one of json, regex, choice, grammar,
    json_object, structural_tag, plus the JSON options."""
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False, populate_by_name=True)
    json_: Optional[Union[dict[str, Any], str]] = Field(None, alias="json")
    regex: Optional[str] = None
    choice: Optional[list[str]] = None
    grammar: Optional[str] = None
    json_object: Optional[bool] = None
    structural_tag: Optional[Union[dict[str, Any], str]] = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: Optional[str] = None


class StructuredOutputFields(FieldAudit):
    """Fields of completions and chat that constrain the output to a grammar."""
    response_format: Optional[ResponseFormat] = None
    structured_outputs: Optional[StructuredOutputsRequest] = None
    # vLLM's older names, still sent by many clients.
    guided_json: Optional[Union[dict[str, Any], str]] = None
    guided_regex: Optional[str] = None
    guided_choice: Optional[list[str]] = None
    guided_grammar: Optional[str] = None
    guided_whitespace_pattern: Optional[str] = None
    guided_decoding_backend: Optional[str] = None


# ---- tools ----------------------------------------------------------------------------------

class FunctionDefinition(Request):
    name: str = Field(pattern=FUNCTION_NAME)
    description: Optional[str] = None
    parameters: Optional[dict[str, Any]] = None
    strict: Optional[bool] = None


class ChatTool(Request):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(Request):
    name: str = Field(pattern=FUNCTION_NAME)


class NamedToolChoice(Request):
    type: Literal["function"]
    function: NamedFunction


ToolChoice = Union[Literal["none", "auto", "required"], NamedToolChoice]


class ToolCallFunction(Request):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class MessageToolCall(Request):
    """A tool call of an earlier assistant turn, sent back in the history."""
    id: str
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ChatToolFields(FieldAudit):
    tools: Optional[list[ChatTool]] = Field(None, max_length=MAX_TOOLS)
    tool_choice: Optional[ToolChoice] = None
    parallel_tool_calls: Optional[bool] = None
    # vLLM's: extra keyword arguments of the chat template (e.g. Qwen3's enable_thinking).
    chat_template_kwargs: Optional[dict[str, Any]] = None


class MessageExtras(Request):
    """What OpenAI's assistant and tool messages add to a plain chat message."""
    tool_calls: Optional[list[MessageToolCall]] = None
    tool_call_id: Optional[str] = None
    reasoning_content: Optional[str] = None
    # Accepted only at their no-op value (see FieldAudit.UNSUPPORTED of the request).
    refusal: Optional[str] = None
    audio: Optional[dict[str, Any]] = None
    function_call: Optional[dict[str, Any]] = None


# ---- responses ------------------------------------------------------------------------------

def _without_nones(model: BaseModel, handler: Any) -> dict:
    return {k: v for k, v in handler(model).items() if v is not None}


class FunctionCall(OpenAIModel):
    name: str
    arguments: str


class ToolCall(OpenAIModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class DeltaFunctionCall(OpenAIModel):
    name: Optional[str] = None
    arguments: Optional[str] = None

    @model_serializer(mode="wrap")
    def _drop_unset(self, handler):
        return _without_nones(self, handler)


class DeltaToolCall(OpenAIModel):
    """OpenAI's streamed tool call: the first delta of a call has index, id, type and
    function.name; the next ones only index and function.arguments fragments."""
    index: int
    id: Optional[str] = None
    type: Optional[Literal["function"]] = None
    function: Optional[DeltaFunctionCall] = None

    @model_serializer(mode="wrap")
    def _drop_unset(self, handler):
        return _without_nones(self, handler)


class SamplingFields(StructuredOutputFields):
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
    repetition_penalty: Optional[float] = Field(None, ge=MIN_REPETITION_PENALTY, le=2.0)
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


_NOT_STORED = "pagedserve stores no completions"
# Fields of both APIs accepted only at a no-op value: {field: (no-op values besides None, why)}.
_COMMON_UNSUPPORTED = {
    # vLLM's extras that change the output, which a vLLM user may send.
    "logits_processors": (([],), "logits_processors is not supported"),
    "vllm_xargs": (({},), "vllm_xargs is not supported"),
    "kv_transfer_params": ((), "KV transfer (disaggregated serving) is not supported"),
    "ec_transfer_params": (({},), "encoder-cache transfer (disaggregated serving) is not supported"),
    "logprob_token_ids": (([],), "logprobs of chosen token ids are not supported: use logprobs "
                                 "(the top ones) or prompt_logprobs"),
    "thinking_token_budget": ((-1,), "thinking_token_budget is not supported (-1, unlimited, is)"),
    # vLLM reads these on its /render endpoints only, which pagedserve does not serve
    "return_token_offsets": ((False,), "token offsets are returned by vLLM's /render endpoints "
                                       "only, which pagedserve does not serve"),
}


class RepetitionDetection(Request):
    """vLLM's repetition_detection (sampling_params.RepetitionDetectionParams checks the rest)."""
    max_pattern_size: int = Field(0, ge=0, le=MAX_TOKEN_ID)
    min_pattern_size: int = Field(0, ge=0, le=MAX_TOKEN_ID)
    min_count: int = Field(0, ge=0, le=MAX_TOKEN_ID)


class VLLMExtraFields(FieldAudit):
    """vLLM's request extras pagedserve accepts only at their no-op value (_COMMON_UNSUPPORTED)."""
    # honoured: a beam search of width n (entrypoints/openai/beam_search.py, its own 400s)
    use_beam_search: Optional[bool] = None
    length_penalty: Optional[float] = None
    # honoured: the prompt's logprobs with this many alternatives, <= --max-logprobs
    # (serving_common.check_prompt_logprobs); refused with stream, as vLLM refuses it
    prompt_logprobs: Optional[int] = Field(None, ge=-1, le=MAX_TOKEN_ID)  # -1: the whole vocabulary (vLLM's)
    bad_words: Optional[Annotated[list[str], Field(max_length=MAX_STOP)]] = None  # honoured (engine/bad_words.py)
    allowed_token_ids: Optional[list[int]] = None  # honoured: only these may be drawn
    logits_processors: Optional[list[Any]] = None
    # honoured: keep the prompt's last k tokens (-1: max_model_len's worth), as vLLM
    truncate_prompt_tokens: Optional[Annotated[int, Field(ge=-1, le=MAX_TOKEN_ID)]] = None
    priority: Optional[int] = Field(None, ge=-(2**31), le=2**31 - 1)  # honoured with --scheduling-policy priority
    return_tokens_as_token_ids: Optional[bool] = None  # honoured: logprobs name tokens "token_id:N"
    # honoured as vLLM honours it (engine/detokenizer.py); only with skip_special_tokens=false
    spaces_between_special_tokens: Optional[bool] = None
    cache_salt: Optional[str] = Field(None, min_length=1)  # honoured: prefix cache shared only within a salt
    # honoured: the side truncate_prompt_tokens cuts (left keeps the last ids: vLLM's default)
    truncation_side: Optional[Literal["left", "right"]] = None
    # honoured: the response's id is cmpl- / chatcmpl-<request_id> (an X-Request-Id header wins,
    # as in vLLM); the engine's own ids stay random, so equal ids never collide there
    request_id: Optional[str] = Field(None, min_length=1, max_length=256)
    # honoured: each choice carries its token_ids, and prompt_token_ids (streamed: in the first chunk)
    return_token_ids: Optional[bool] = None
    vllm_xargs: Optional[dict[str, Any]] = None
    kv_transfer_params: Optional[dict[str, Any]] = None
    ec_transfer_params: Optional[dict[str, Any]] = None
    logprob_token_ids: Optional[list[int]] = None
    # honoured: finish_reason "repetition" once the output ends in a repeated token pattern
    repetition_detection: Optional[RepetitionDetection] = None
    thinking_token_budget: Optional[int] = None
    return_token_offsets: Optional[bool] = None


class CompletionRequest(SamplingFields, VLLMExtraFields):
    UNSUPPORTED: ClassVar[dict[str, tuple[tuple, str]]] = {
        **_COMMON_UNSUPPORTED,
        "suffix": (("",), "suffix (insertion) is not supported"),
        "prompt_embeds": ((), "prompt_embeds are not supported: send the prompt as text or token ids"),
    }
    prompt: PromptType
    prompt_embeds: Optional[Any] = None
    add_special_tokens: bool = True  # honoured: a text prompt's BOS (and the like) from the tokenizer
    max_tokens: Optional[int] = Field(16, ge=0, le=MAX_TOKEN_ID)  # 0: with echo, score the prompt only
    best_of: Optional[int] = Field(None, ge=1, le=MAX_N)
    logprobs: Optional[int] = Field(None, ge=0, le=MAX_TOKEN_ID)  # <= --max-logprobs: serving_common
    echo: Optional[bool] = False
    suffix: Optional[str] = None
    logit_bias: Optional[dict[str, float]] = None  # honoured: token id (as a string) -> [-100, 100]


class CompletionLogProbs(OpenAIModel):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[Optional[float]] = Field(default_factory=list)
    top_logprobs: list[Optional[dict[str, float]]] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class PromptLogprob(OpenAIModel):
    """vLLM's Logprob as its server writes it in prompt_logprobs."""
    logprob: float
    rank: Optional[int] = None
    decoded_token: Optional[str] = None


# vLLM's prompt_logprobs: per prompt token, token id -> PromptLogprob (the prompt's own token
# first, then the top k), null at the first token; only in a response to a request that asked.
PromptLogprobs = Optional[list[Optional[dict[int, PromptLogprob]]]]


# vLLM's stop_reason beside finish_reason (choices of completions and chat, streamed or not): the
# stop string or stop token id that ended the choice; null for EOS, the length limit, or none yet.
StopReason = Optional[Union[int, str]]


class CompletionChoice(OpenAIModel):
    index: int
    text: str
    logprobs: Optional[CompletionLogProbs] = None
    finish_reason: Optional[str] = None
    stop_reason: StopReason = None
    prompt_logprobs: PromptLogprobs = Field(None, exclude_if=lambda v: v is None)
    # vLLM's, with return_token_ids (streamed: the prompt's in a choice's first chunk)
    prompt_token_ids: Optional[list[int]] = Field(None, exclude_if=lambda v: v is None)
    token_ids: Optional[list[int]] = Field(None, exclude_if=lambda v: v is None)


class PromptTokensDetails(OpenAIModel):
    cached_tokens: int = 0


class Usage(OpenAIModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    # With --enable-prompt-tokens-details (vLLM's): prompt tokens read from the prefix cache.
    prompt_tokens_details: Optional[PromptTokensDetails] = Field(None, exclude_if=lambda v: v is None)


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


class ChatMessage(MessageExtras):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Union[str, list[TextPart], None] = None
    name: Optional[str] = None


class ChatCompletionRequest(SamplingFields, ChatToolFields, VLLMExtraFields):
    UNSUPPORTED: ClassVar[dict[str, tuple[tuple, str]]] = {
        **_COMMON_UNSUPPORTED,
        "chat_template": ((), "a per-request chat_template is not supported: the server's "
                              "template (the model's, or --chat-template) renders every request"),
        "documents": (([],), "documents are not supported"),
        "audio": ((), "audio output is not supported (text models only)"),
        "modalities": ((["text"],), "only the text modality is supported"),
        "prediction": ((), "predicted outputs are not supported"),
        "web_search_options": ((), "web search is not supported"),
        "store": ((False,), _NOT_STORED),
        "metadata": (({},), f"metadata is kept with stored completions; {_NOT_STORED}"),
        "service_tier": (("auto", "default"), "there is one service tier: auto / default"),
        "reasoning_effort": ((), "reasoning_effort is not supported; for Qwen3-style thinking "
                                 "use chat_template_kwargs={\"enable_thinking\": ...}"),
        "functions": (([],), "functions is deprecated by OpenAI and not supported: use tools"),
        "function_call": ((), "function_call is deprecated by OpenAI and not supported: use "
                              "tool_choice"),
        "moderation": ((), "moderation is not supported"),
        "verbosity": ((), "verbosity is not supported"),
        "prompt_cache_retention": (("in_memory",), "the prefix cache lives in memory only"),
        "prompt_cache_options": (({},), "prompt_cache_options is not supported"),
        "media_io_kwargs": (({},), "multimodal inputs are not supported (text models only)"),
        "mm_processor_kwargs": (({},), "multimodal inputs are not supported (text models only)"),
        "return_assistant_tokens_mask": ((False,), "the assistant tokens mask is returned by vLLM's "
                                                   "/render endpoints only, which pagedserve does not serve"),
    }
    # OpenAI fields kept for the audit above; prompt_cache_key and safety_identifier are hints
    # and identifiers with nothing to do here (the prefix cache is automatic), like `user`.
    audio: Optional[Any] = None
    modalities: Optional[list[str]] = None
    prediction: Optional[Any] = None
    web_search_options: Optional[Any] = None
    store: Optional[bool] = None
    metadata: Optional[dict[str, Any]] = None
    service_tier: Optional[str] = None
    reasoning_effort: Optional[str] = None
    functions: Optional[list[Any]] = None
    function_call: Optional[Any] = None
    moderation: Optional[Any] = None
    verbosity: Optional[str] = None
    prompt_cache_key: Optional[str] = None
    prompt_cache_retention: Optional[str] = None
    prompt_cache_options: Optional[Any] = None
    safety_identifier: Optional[str] = None
    # vLLM's chat extras: continue_final_message, return_prompt_text, echo (the last message's
    # content before the answer's, where its role is the answer's), add_special_tokens (added to
    # the rendered prompt, as vLLM's tokenizer call adds them) and include_reasoning (false: no
    # reasoning_content, and no logprobs or token_ids that would show it) are honoured; the
    # others are audited above.
    continue_final_message: bool = False
    add_special_tokens: bool = False
    include_reasoning: bool = True
    media_io_kwargs: Optional[dict[str, Any]] = None
    mm_processor_kwargs: Optional[dict[str, Any]] = None
    return_prompt_text: Optional[bool] = None
    return_assistant_tokens_mask: Optional[bool] = None
    echo: Optional[bool] = None
    chat_template: Optional[str] = None
    documents: Optional[list[dict[str, Any]]] = None
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_tokens: Optional[int] = Field(None, ge=1, le=MAX_TOKEN_ID)
    max_completion_tokens: Optional[int] = Field(None, ge=1, le=MAX_TOKEN_ID)
    logprobs: Optional[bool] = False
    top_logprobs: Optional[int] = Field(None, ge=-1, le=MAX_TOKEN_ID)  # <= --max-logprobs, -1 the vocabulary: serving_common
    logit_bias: Optional[dict[str, float]] = None  # honoured: token id (as a string) -> [-100, 100]
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
    # assistant, or with add_generation_prompt=false the last message's role (vLLM's rule)
    role: str = "assistant"
    content: Optional[str] = None
    reasoning_content: Optional[str] = None  # vLLM's, with --reasoning-parser
    tool_calls: Optional[list[ToolCall]] = None


class ChatChoice(OpenAIModel):
    index: int
    message: ChatResponseMessage
    logprobs: Optional[ChatLogprobs] = None
    finish_reason: Optional[str] = None
    stop_reason: StopReason = None
    token_ids: Optional[list[int]] = Field(None, exclude_if=lambda v: v is None)  # return_token_ids


class ChatCompletionResponse(OpenAIModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=now)
    model: str
    choices: list[ChatChoice]
    usage: Optional[Usage] = None
    prompt_logprobs: PromptLogprobs = Field(None, exclude_if=lambda v: v is None)  # vLLM's, at the top
    prompt_token_ids: Optional[list[int]] = Field(None, exclude_if=lambda v: v is None)  # return_token_ids
    prompt_text: Optional[str] = Field(None, exclude_if=lambda v: v is None)  # return_prompt_text


class DeltaMessage(OpenAIModel):
    role: Optional[str] = None
    content: Optional[str] = None
    reasoning_content: Optional[str] = None
    tool_calls: Optional[list[DeltaToolCall]] = None

    @model_serializer(mode="wrap")
    def _drop_unset(self, handler):
        """OpenAI's deltas carry only the keys that changed."""
        return {k: v for k, v in handler(self).items() if v is not None}


class ChatStreamChoice(OpenAIModel):
    index: int
    delta: DeltaMessage
    logprobs: Optional[ChatLogprobs] = None
    finish_reason: Optional[str] = None
    stop_reason: StopReason = None
    token_ids: Optional[list[int]] = Field(None, exclude_if=lambda v: v is None)  # return_token_ids


class ChatCompletionChunk(OpenAIModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=now)
    model: str
    choices: list[ChatStreamChoice]
    usage: Optional[Usage] = None
    # return_token_ids / return_prompt_text: in the role chunks that open the stream
    prompt_token_ids: Optional[list[int]] = Field(None, exclude_if=lambda v: v is None)
    prompt_text: Optional[str] = Field(None, exclude_if=lambda v: v is None)


# ---- models ---------------------------------------------------------------------------------

class ModelPermission(OpenAIModel):
    """vLLM's one permission entry of a model card (OpenAI's older shape, which some clients read)."""
    id: str = Field(default_factory=lambda: random_id("modelperm"))
    object: Literal["model_permission"] = "model_permission"
    created: int = Field(default_factory=now)
    allow_create_engine: bool = False
    allow_sampling: bool = True
    allow_logprobs: bool = True
    allow_search_indices: bool = False
    allow_view: bool = True
    allow_fine_tuning: bool = False
    organization: str = "*"
    group: Optional[str] = None
    is_blocking: bool = False


class ModelCard(OpenAIModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=now)
    owned_by: str = "pagedserve"
    # vLLM's: root is the model as given to serve (its path), parent a LoRA's base (none here)
    root: Optional[str] = None
    parent: Optional[str] = None
    max_model_len: Optional[int] = None
    permission: list[ModelPermission] = Field(default_factory=lambda: [ModelPermission()])
    # Not OpenAI's: lets clients (`pagedserve bench serve`) send valid token-id prompts.
    vocab_size: Optional[int] = None


class ModelList(OpenAIModel):
    object: Literal["list"] = "list"
    data: list[ModelCard] = Field(default_factory=list)


def dump(model: BaseModel, **kw: Any) -> str:
    """JSON of a response model, leaving out nothing (OpenAI sends explicit nulls)."""
    return model.model_dump_json(**kw)
