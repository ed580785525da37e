"""What completions and chat share: errors, limits, SamplingParams, stream merging (logprob token
names: logprob_names.py)."""
from __future__ import annotations

import asyncio
import json
import logging
import re
from dataclasses import dataclass
from typing import Any, AsyncIterator, Iterable

from pagedserve.engine.async_engine import AsyncLLMEngine, EngineDeadError
from pagedserve.engine.request_stream import RequestStream
from pagedserve.engine.input_processor import truncation_size
from pagedserve.entrypoints.openai.logprob_names import LogprobNames
from pagedserve.entrypoints.openai.protocol import (ErrorInfo, ErrorResponse, PromptTokensDetails, SamplingFields,
                                                    Usage, random_id)
from pagedserve.sampling_params import (BeamSearchParams, RequestOutputKind, SamplingParams,
                                         StructuredOutputsParams)

logger = logging.getLogger("pagedserve.server")

MAX_CHOICES = 256  # prompts x n in one request; each one is a sequence in the batch

_SAMPLING_FIELDS = ("n", "best_of", "temperature", "top_p", "top_k", "min_p", "seed", "max_tokens",
                    "min_tokens", "stop", "stop_token_ids", "ignore_eos", "logprobs", "prompt_logprobs",
                    "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias",
                    "allowed_token_ids", "priority", "cache_salt", "bad_words", "repetition_detection")


class APIError(Exception):
    """An error the client caused (or, with status 5xx, one it did not), as OpenAI reports it."""

    def __init__(self, message: str, status: int = 400, param: str | None = None,
                 type: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.headers = headers  # e.g. Retry-After on a 503
        self.message = message
        self.status = status
        self.param = param
        self.type = type or ("invalid_request_error" if status < 500 else "server_error")
        self.code = code

    def response(self) -> ErrorResponse:
        return ErrorResponse(error=ErrorInfo(message=self.message, type=self.type, param=self.param,
                                             code=self.code))

    @classmethod
    def from_value_error(cls, e: ValueError, fields=_SAMPLING_FIELDS) -> "APIError":
        """Engine-side ValueErrors start with (or quote) the field name: recover it for `param`."""
        msg = str(e)
        m = re.match(r"\W*([A-Za-z_][A-Za-z_0-9]*)", msg)
        param = m.group(1) if m and m.group(1) in fields else None
        if param is None:
            for f in fields:
                if re.search(rf"\b{f}\b", msg):
                    param = f
                    break
        if param is None and "prompt" in msg:
            param = "prompt"
        return cls(msg, 400, param=param)


def check_not_ignored(out: Any, prompt_param: str, constraint_param: str | None = None) -> None:
    """The scheduler drops ("ignored") a request that can never be scheduled: a 400, not text.
    A request the core ended alone with an error (its grammar failed to compile, compiled too
    slowly, or accepted no token) is a 400 saying so, not an empty "abort", naming the field that
    set the constraint (constraint_param: resolve_structured_outputs' second item)."""
    if getattr(out, "error", None):
        raise APIError(out.error, param=constraint_param, code="structured_outputs_failed")
    if any(c.finish_reason == "ignored" for c in out.outputs):
        raise APIError(f"the {prompt_param} can never be scheduled: it does not fit in the KV cache",
                       param=prompt_param, code="kv_cache_capacity_exceeded")


@dataclass
class StreamedChoice:
    """What has been streamed of one choice so far; the engine sends it DELTA outputs."""
    num_tokens: int = 0
    text_offset: int = 0     # completions' logprobs text_offset
    finished: bool = False

    def take(self, delta: Any, extra_text: str = "") -> bool:
        """Whether this delta (a CompletionOutput) is worth a chunk; if so, counts it as sent."""
        if self.finished or not (delta.token_ids or delta.text or extra_text or delta.finish_reason):
            return False
        self.num_tokens += len(delta.token_ids)
        self.finished = delta.finish_reason is not None
        return True


def sse(obj: Any) -> str:
    """One server-sent event carrying JSON."""
    data = obj if isinstance(obj, str) else obj.model_dump_json()
    return f"data: {data}\n\n"


SSE_DONE = "data: [DONE]\n\n"


def error_event(err: APIError) -> str:
    return sse(json.dumps(err.response().model_dump()))


def request_ids(prefix: str, req: Any, raw_request: Any) -> tuple[str, str]:
    """(the response's id, the base of the engine's request ids). As in vLLM, an X-Request-Id
    header, else the request_id field, names the response <prefix>-<id>. The engine's ids stay
    random: two clients may send one id, and a client's text in them would reach the logs."""
    headers = getattr(raw_request, "headers", None)
    given = (headers.get("x-request-id") if headers is not None else None) or req.request_id
    if given is None:
        rid = random_id(prefix)
        return rid, rid
    if len(given) > 256:
        raise APIError(f"the request id has {len(given)} characters, more than 256",
                       param="request_id")
    return f"{prefix}-{given}", random_id(prefix)


class OpenAIServing(LogprobNames):
    """Base of the completion and chat handlers: one engine, one served model name."""

    def __init__(self, engine: AsyncLLMEngine, served_model_name: str,
                 default_sampling: dict | None = None) -> None:
        """default_sampling: what a request that leaves a sampling field unset gets instead of
        SamplingParams' default (engine/generation_defaults.py: the model's generation config)."""
        self.engine = engine
        self.served_model_name = served_model_name
        self.default_sampling = dict(default_sampling or {})
        self._token_str_cache: dict[int, str] = {}
        # `serve` flags (build_app sets them): --enable-log-requests, --return-tokens-as-token-ids.
        self.log_requests = False
        self.tokens_as_ids_default = False
        self.prompt_tokens_details = False  # --enable-prompt-tokens-details

    def tokens_as_ids(self, req: Any) -> bool:
        """return_tokens_as_token_ids: the request's, else the server's --return-tokens-as-token-ids."""
        value = getattr(req, "return_tokens_as_token_ids", None)
        return self.tokens_as_ids_default if value is None else bool(value)

    def cached_tokens(self, outs: Iterable[Any]) -> int | None:
        """usage.prompt_tokens_details.cached_tokens of these outputs (one per prompt), under
        --enable-prompt-tokens-details; else None (the field is left out)."""
        if not self.prompt_tokens_details:
            return None
        return sum(o.num_cached_tokens or 0 for o in outs)

    def audit(self, req: Any) -> None:
        """No silent drops: an OpenAI field pagedserve does not honour, set to anything but its
        no-op value, is a 400 naming it; keys outside the API are ignored (as vLLM ignores
        them) with one log line."""
        for name, why in req.unsupported_fields():
            raise APIError(f"{name}: {why}", param=name)
        so = getattr(req, "stream_options", None)  # (/tokenize has none)
        if so is not None and so.model_fields_set and not req.stream:
            # vLLM's check and words: without a stream they would be dropped (an empty object
            # passes, as it does in vLLM)
            raise APIError("Stream options can only be defined when `stream=True`.",
                           param="stream_options")
        if so is not None:
            if so.include_obfuscation:
                raise APIError("stream_options.include_obfuscation is not supported",
                               param="stream_options.include_obfuscation")
        if req._unknown_keys:
            # The client's own key names: repr() so that none can forge a log line (a newline in a
            # key did, in the shared test server's log), and at most 10 of them, each cut at 64.
            keys = req._unknown_keys
            shown = ", ".join(repr(k[:64]) for k in keys[:10])
            more = f" and {len(keys) - 10} more" if len(keys) > 10 else ""
            logger.warning("The following fields were present in the request but ignored: %s%s", shown, more)

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.served_model_name:
            raise APIError(f"The model `{model}` does not exist; this server serves "
                           f"`{self.served_model_name}`.", 404, param="model", code="model_not_found")

    def check_text_length(self, chars: int, param: str) -> None:
        """Reject text that cannot fit max_model_len before tokenizing it (a 900 KB prompt took
        the one tokenizer thread for 0.3 s, and everyone's requests waited behind it).

        Sound: no token covers more than max_token_bytes bytes of text (the longest entry of
        the vocabulary, in UTF-8, bounds it), and a character is at least one byte, so text of
        more than max_model_len * max_token_bytes characters has more than max_model_len tokens."""
        bound = self._max_token_bytes()
        if bound and chars > self.engine.max_model_len * bound:
            raise APIError(f"This model's maximum context length is {self.engine.max_model_len} tokens; "
                           f"the {param} has {chars} characters, more than any text of that many tokens "
                           f"can have ({self.engine.max_model_len} x {bound}).",
                           param=param, code="context_length_exceeded")

    def _max_token_bytes(self) -> int:
        bound = getattr(self, "_token_bytes_bound", None)
        if bound is None:
            tok = self.engine.tokenizer
            vocab = tok.get_vocab() if tok is not None else {}
            bound = self._token_bytes_bound = max((len(t.encode("utf-8", "replace")) for t in vocab), default=0)
        return bound

    def check_token_ids(self, ids: list[int], param: str) -> None:
        vocab = self.engine.vocab_size
        bad = next((t for t in ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise APIError(f"{param} contains token id {bad}, outside the vocabulary [0, {vocab})",
                           param=param)

    def resolve_max_tokens(self, prompt_len: int, max_tokens: int | None, prompt_param: str,
                           tokens_param: str = "max_tokens", num_seqs: int = 1) -> int:
        """max_tokens that fits max_model_len; None means 'the rest of the context' (and of
        what the KV cache can hold for num_seqs sequences)."""
        limit = self.engine.max_model_len
        if prompt_len == 0:
            raise APIError(f"{prompt_param} must not be empty", param=prompt_param)
        if prompt_len >= limit:
            raise APIError(f"This model's maximum context length is {limit} tokens, but the "
                           f"{prompt_param} has {prompt_len} tokens, leaving no room for output.",
                           param=prompt_param, code="context_length_exceeded")
        if max_tokens is None:
            num_blocks, bs = self.engine.kv_cache_shape
            room = (num_blocks // num_seqs) * bs - prompt_len
            default = self.default_sampling.get("max_tokens", limit)  # the generation config's max_new_tokens
            return max(1, min(limit - prompt_len, room, default))
        if prompt_len + max_tokens > limit:
            raise APIError(f"This model's maximum context length is {limit} tokens. However, you "
                           f"requested {prompt_len + max_tokens} tokens ({prompt_len} in the "
                           f"{prompt_param}, {max_tokens} in {tokens_param}). Please reduce the "
                           f"length of the {prompt_param} or {tokens_param}.",
                           param=tokens_param, code="context_length_exceeded")
        return max_tokens

    def truncation_size(self, keep: int | None, max_tokens: int | None, tokens_param: str) -> int | None:
        """truncate_prompt_tokens as the number of ids to keep (input_processor.truncated_prompt
        keeps them). vLLM's server bounds it by max_model_len - max_tokens (its TokenizeParams'
        max_input_tokens, an unset max_tokens counting 0): -1 keeps that many, more is a 400,
        whatever the prompt's length. tokens_param: the field max_tokens came from."""
        try:
            return truncation_size(keep, self.engine.max_model_len - (max_tokens or 0),
                                   f"max_model_len - {tokens_param}")
        except ValueError as e:
            raise APIError(str(e), param="truncate_prompt_tokens") from None

    def check_kv_capacity(self, prompt_len: int, max_tokens: int, num_seqs: int,
                          prompt_param: str, tokens_param: str = "max_tokens") -> None:
        """Reject what can never fit in the whole KV cache, instead of letting it wait forever.

        Worst case, every one of the request's sequences holds its own blocks for
        prompt + max_tokens tokens (prefix sharing only ever lowers this).
        """
        num_blocks, bs = self.engine.kv_cache_shape
        per_seq = -(-(prompt_len + max_tokens) // bs)
        if num_seqs * per_seq <= num_blocks:
            return
        if -(-prompt_len // bs) > num_blocks:
            param = prompt_param
        elif per_seq > num_blocks:
            param = tokens_param
        else:
            param = "n"
        raise APIError(f"This request needs up to {num_seqs * per_seq} KV-cache blocks ({num_seqs} "
                       f"sequence(s) of {prompt_len} prompt + {max_tokens} new tokens, block size "
                       f"{bs}) but the whole cache holds {num_blocks} blocks; reduce {param}.",
                       param=param, code="kv_cache_capacity_exceeded")

    def sampling_params(self, req: SamplingFields, *, max_tokens: int, logprobs: int | None,
                        best_of: int | None = None,
                        structured_outputs: StructuredOutputsParams | None = None,
                        skip_special_tokens: bool | None = None,
                        prompt_logprobs: int | None = None) -> SamplingParams:
        """Streams take DELTA outputs (O(new) per step); a plain response needs only the end."""
        kind = RequestOutputKind.DELTA if req.stream else RequestOutputKind.FINAL_ONLY
        kw: dict[str, Any] = dict(
            output_kind=kind, n=req.n, best_of=best_of, max_tokens=max_tokens, logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            min_tokens=req.min_tokens, stop=req.stop, stop_token_ids=req.stop_token_ids,
            ignore_eos=req.ignore_eos, seed=req.seed,
            skip_special_tokens=(req.skip_special_tokens if skip_special_tokens is None
                                 else skip_special_tokens),
            include_stop_str_in_output=req.include_stop_str_in_output,
            structured_outputs=structured_outputs)
        for name in ("temperature", "top_p", "top_k", "min_p", "presence_penalty",
                     "frequency_penalty", "repetition_penalty"):
            v = getattr(req, name)
            if v is None:
                v = self.default_sampling.get(name)
            if v is not None:
                kw[name] = v
        if req.stop_token_ids:
            self.check_token_ids(req.stop_token_ids, "stop_token_ids")
        if req.logit_bias:
            kw["logit_bias"] = self.logit_bias(req.logit_bias)
        if req.bad_words:
            kw["bad_words"] = req.bad_words
        if req.allowed_token_ids is not None:
            self.check_token_ids(req.allowed_token_ids, "allowed_token_ids")
            kw["allowed_token_ids"] = req.allowed_token_ids
        if req.spaces_between_special_tokens is not None:
            kw["spaces_between_special_tokens"] = req.spaces_between_special_tokens
        if req.repetition_detection is not None:  # (its own checks name it: from_value_error)
            kw["repetition_detection"] = req.repetition_detection.model_dump()
        try:
            return SamplingParams(**kw)
        except ValueError as e:
            raise APIError.from_value_error(e) from None

    def logit_bias(self, bias: dict[str, float]) -> dict[int, float]:
        """OpenAI's logit_bias: token ids as strings, biases in [-100, 100]."""
        try:
            out = {int(k): float(v) for k, v in bias.items()}
        except ValueError:
            raise APIError(f"logit_bias keys must be token ids, got {list(bias)[:5]}", param="logit_bias") from None
        self.check_token_ids(list(out), "logit_bias")
        return out

    def check_logprobs(self, k: int | None, param: str) -> int | None:
        """The server's --max-logprobs (vLLM's, 20 by default), named as the request names it.
        Returns k, with vLLM's -1 (the whole vocabulary) as the vocabulary's size."""
        limit, asked = self.engine.max_logprobs, k
        if k == -1:
            k = self.engine.vocab_size
        if k is not None and k > limit:
            shown = f"-1 (the whole vocabulary, {k})" if asked == -1 else k
            raise APIError(f"{param} must be <= {limit} (the server's --max-logprobs), got {shown}", param=param)
        return k

    def check_prompt_logprobs(self, req: Any) -> int | None:
        """vLLM's prompt_logprobs field: <= --max-logprobs, and no prompt logprobs in a stream
        (vLLM's words; 0 streams, with nothing to return). Returns what the engine is asked for."""
        k = self.check_logprobs(req.prompt_logprobs, "prompt_logprobs")
        if req.stream and k:
            raise APIError("`prompt_logprobs` are not available when `stream=True`.", param="prompt_logprobs")
        return None if req.stream else k

    @staticmethod
    def check_choices(num_prompts: int, n: int) -> None:
        if num_prompts * n > MAX_CHOICES:
            raise APIError(f"n * number of prompts must be <= {MAX_CHOICES}, got "
                           f"{n} * {num_prompts}", param="n")

    async def start(self, prompt_ids: list[int], params: SamplingParams,
                    request_id: str, cache_salt: str | None = None, priority: int | None = None) -> RequestStream:
        """Hand one prompt to the engine; its ValueError becomes a 400. cache_salt (vLLM's): the
        prompt shares cached KV blocks only with requests of the same salt."""
        if self.log_requests:
            logger.info("request %s: %d prompt tokens, %s", request_id, len(prompt_ids), params)
        try:
            prompt = {"prompt_token_ids": prompt_ids}
            if cache_salt is not None:
                prompt["cache_salt"] = cache_salt
            return await self.engine.add_request(request_id, prompt, params, priority or 0)
        except ValueError as e:
            raise APIError.from_value_error(e) from None
        except EngineDeadError as e:
            raise engine_error(e) from None

    async def start_beam(self, prompt_ids: list[int], params: BeamSearchParams, request_id: str,
                         req: Any, skip_special_tokens: bool | None = None) -> RequestStream:
        """start() for a beam search (entrypoints/openai/beam_search.py): one output, at its end.
        skip_special_tokens: overrides the request's (a tool parser reads special tokens)."""
        if self.log_requests:
            logger.info("request %s: %d prompt tokens, %s", request_id, len(prompt_ids), params)
        prompt = {"prompt_token_ids": prompt_ids}
        if req.cache_salt is not None:
            prompt["cache_salt"] = req.cache_salt
        try:
            return await self.engine.add_beam_search_request(
                request_id, prompt, params, req.priority or 0,
                skip_special_tokens=req.skip_special_tokens if skip_special_tokens is None else skip_special_tokens,
                include_stop_str_in_output=req.include_stop_str_in_output)
        except ValueError as e:
            raise APIError.from_value_error(e) from None
        except EngineDeadError as e:
            raise engine_error(e) from None


def continuous_usage(req: Any) -> bool:
    """vLLM's stream_options.continuous_usage_stats: with include_usage, every chunk carries its
    choice's usage so far (its prompt's tokens, the tokens it has streamed)."""
    so = req.stream_options
    return bool(so and so.include_usage and so.continuous_usage_stats)


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int | None = None) -> Usage:
    """cached_tokens: given (--enable-prompt-tokens-details), usage.prompt_tokens_details carries it."""
    details = None if cached_tokens is None else PromptTokensDetails(cached_tokens=cached_tokens)
    return Usage(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                 total_tokens=prompt_tokens + completion_tokens, prompt_tokens_details=details)


async def merge_streams(streams: list[RequestStream]) -> AsyncIterator[tuple[int, Any]]:
    """Interleave several async iterators as (index, item); closing this closes them all."""
    if len(streams) == 1:
        try:
            async for item in streams[0]:
                yield 0, item
        finally:
            streams[0].close()
        return
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(i: int, it: RequestStream) -> None:
        try:
            async for item in it:
                await queue.put((i, item))
            await queue.put((i, done))
        except asyncio.CancelledError:
            raise
        except BaseException as e:
            await queue.put((i, e))
        finally:
            it.close()

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    remaining = len(tasks)
    try:
        while remaining:
            i, item = await queue.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
        for s in streams:  # a task cancelled before it ran never reaches its own finally
            s.close()
        await asyncio.gather(*tasks, return_exceptions=True)


def engine_error(e: EngineDeadError) -> APIError:
    """500 for a failed step, 503 once the engine core is gone."""
    code = getattr(e, "code", None) or ("engine_dead" if e.status == 503 else None)
    return APIError(str(e), e.status, code=code)


class ClientDisconnected(Exception):
    pass


async def until_disconnected(raw_request: Any, coro) -> Any:
    """Await coro, but cancel it (aborting its requests) if the HTTP client goes away."""
    work = asyncio.ensure_future(coro)

    async def listen() -> None:
        while True:
            message = await raw_request.receive()
            if message["type"] == "http.disconnect":
                return

    watcher = asyncio.ensure_future(listen())
    try:
        await asyncio.wait({work, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        work.cancel()
        watcher.cancel()
        raise
    watcher.cancel()
    if work.done():
        return work.result()
    work.cancel()
    await asyncio.gather(work, return_exceptions=True)
    raise ClientDisconnected()
