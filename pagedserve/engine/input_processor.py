"""Input processing: a prompt (text, token ids, or a dict of either) and its SamplingParams
become validated token ids, or a ValueError that names the field and the limit.

The engine owns request ids and groups; this owns what a request may ask for, given the model
(vocabulary, context length) and the KV cache (a request that could never fit is refused now,
not halfway through).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Iterable

from pagedserve.core.config import CacheConfig
from pagedserve.sampling_params import SamplingParams


# transformers' own "no limit" value (VERY_LARGE_INTEGER).
NO_TOKENIZER_LIMIT = int(1e30)


def load_tokenizer(path: str, chat_template: str | None = None) -> Any:
    """The tokenizer of a local HF directory. Its own length limit (model_max_length) is lifted:
    the engine's max_model_len is the limit, refused with a message naming it, so transformers'
    "Token indices sequence length is longer than..." warning would only repeat it, worse.
    chat_template: a --chat-template value (engine/chat_template.py) replacing the tokenizer's."""
    from transformers import AutoTokenizer

    from pagedserve.engine.preflight import check_tokenizer_dir
    check_tokenizer_dir(path)  # one line naming the path, not the hub's "Repo id must be..."
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True, trust_remote_code=False)
    except (OSError, ValueError) as e:
        raise ValueError(f"tokenizer: cannot load a tokenizer from {path!r} (a local HF directory): {e}") from e
    tokenizer.model_max_length = NO_TOKENIZER_LIMIT
    # truncate_prompt_tokens cuts a text prompt with the tokenizer's own truncation, which must
    # keep the prompt's end: vLLM loads generative models' tokenizers with this side too.
    tokenizer.truncation_side = "left"
    from pagedserve.engine.chat_template import apply_chat_template_override
    apply_chat_template_override(tokenizer, chat_template)
    return tokenizer


def eos_token_ids(model_dir: str, hf_config: Any, tokenizer: Any | None) -> set[int]:
    """EOS from the tokenizer and generation_config.json (falling back to config.json)."""
    ids: set[int] = set()

    def add(v):
        if isinstance(v, int):
            ids.add(v)
        elif isinstance(v, (list, tuple)):
            ids.update(x for x in v if isinstance(x, int))
    if tokenizer is not None:
        add(tokenizer.eos_token_id)
    try:
        from transformers import GenerationConfig
        add(GenerationConfig.from_pretrained(model_dir, local_files_only=True).eos_token_id)
    except (OSError, ValueError):
        add(getattr(hf_config, "eos_token_id", None))
    return ids


# The dict keys a prompt may carry: vLLM's TextPrompt / TokensPrompt keys that this engine serves.
PROMPT_KEYS = ("prompt", "prompt_token_ids", "cache_salt")
# vLLM's keys for what this engine has no way to serve (multimodal inputs, embeddings as input).
UNSERVED_PROMPT_KEYS = ("multi_modal_data", "mm_processor_kwargs", "multi_modal_uuids", "prompt_embeds",
                        "token_type_ids")


def check_prompt_keys(prompt: dict) -> None:
    """ValueError for a key that would be dropped: multimodal data or a misspelt cache_salt
    was ignored and the prompt ran as if plain text."""
    for key in prompt:
        if key in UNSERVED_PROMPT_KEYS:
            raise ValueError(f"prompt dict key {key!r} is not supported: this engine serves text prompts only "
                             f"({', '.join(PROMPT_KEYS)})")
        if key not in PROMPT_KEYS:
            raise ValueError(f"prompt dict has an unknown key {key!r}; its keys: {', '.join(PROMPT_KEYS)}")


def split_prompt(prompt: Any, can_tokenize: bool) -> tuple[str | None, list[int] | None]:
    """(text, token ids) of a prompt: text, token ids, or a dict of either. The ids are None when
    the text still needs tokenizing (the caller tokenizes where it should: the API process does it
    off its event loop). Raises ValueError for an ill-formed prompt, or for text that cannot be
    tokenized (`can_tokenize` False: skip_tokenizer_init)."""
    if isinstance(prompt, dict):
        check_prompt_keys(prompt)
        if "prompt_token_ids" in prompt:
            ids, text = prompt["prompt_token_ids"], prompt.get("prompt")
            if text is not None and not isinstance(text, str):  # beside the ids it is only the outputs' prompt text
                raise ValueError(f"prompt (beside prompt_token_ids) must be a string, got {type(text).__name__}")
        elif "prompt" in prompt:
            return split_prompt(prompt["prompt"], can_tokenize)
        else:
            raise ValueError("prompt dict must hold 'prompt' or 'prompt_token_ids'")
    elif isinstance(prompt, str):
        if not prompt:
            raise ValueError("prompt must not be empty")
        if not can_tokenize:
            raise ValueError("prompt must be token ids (prompt_token_ids) when skip_tokenizer_init=True")
        return prompt, None
    elif isinstance(prompt, (list, tuple)):
        ids, text = prompt, None
    else:
        # None, a number, bytes...: iterating them failed as "'NoneType' object is not iterable",
        # naming nothing (bytes iterated to their byte values, taken for token ids).
        raise ValueError(f"prompt must be a string, a list of integers (token ids) or a dict (prompt / "
                         f"prompt_token_ids), got {type(prompt).__name__}")
    if not isinstance(ids, (list, tuple)) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        raise ValueError("prompt_token_ids must be a list of integers")
    return text, list(ids)


def truncation_size(keep: int | None, max_input_tokens: int | None,
                    limit_name: str = "max_model_len") -> int | None:
    """truncate_prompt_tokens as the number of ids to keep, as vLLM's TokenizeParams reads it.
    None keeps them all. -1 keeps max_input_tokens (max_model_len offline; max_model_len -
    max_tokens in the server), or all of them where that is unknown (None: the DP router). More
    than max_input_tokens is a ValueError whatever the prompt's length, as vLLM refuses it: such
    a prompt could never run. 0 and below -1 are ValueErrors too (SamplingParams' own check).
    limit_name: how the messages name max_input_tokens."""
    if keep is None:
        return None
    if keep == 0 or keep < -1:
        raise ValueError(f"truncate_prompt_tokens must be >= 1, or -1 ({limit_name}), got {keep}")
    if keep == -1:
        if max_input_tokens is not None and max_input_tokens < 1:
            raise ValueError(f"truncate_prompt_tokens -1 keeps {limit_name} ({max_input_tokens}) tokens: none")
        return max_input_tokens
    if max_input_tokens is not None and keep > max_input_tokens:
        raise ValueError(f"truncate_prompt_tokens ({keep}) must be <= {limit_name} ({max_input_tokens})")
    return keep


def truncated_prompt(tokenizer: Any, prompt: str | list[int], keep: int | None,
                     max_input_tokens: int | None = None,
                     limit_name: str = "max_model_len", side: str | None = None,
                     add_special_tokens: bool = True) -> tuple[list[int], bool]:
    """(the prompt's token ids under truncate_prompt_tokens=keep, whether any were cut): the one
    place that decides it, for the engine (LLM.generate, LLM.chat, AsyncLLMEngine), the server
    (completions, chat) and the DP router's keys, so all three keep the same ids.

    As vLLM's renderer does: text is tokenized with the tokenizer's own truncation (truncation
    True, max_length keep, side left, the side vLLM loads generative models' tokenizers with), so
    the special tokens the tokenizer adds (a BOS) stay and the text keeps its last keep - (their
    number) tokens. Token ids (a chat's rendered prompt among them: its BOS is text of the
    template, tokenized without added special tokens) keep their last keep ids. keep: as
    truncation_size reads it, with max_input_tokens and limit_name. side: vLLM's
    truncation_side, "right" keeping the first ids instead (None: left). add_special_tokens:
    whether a text prompt gets the tokenizer's special tokens (vLLM's completions field)."""
    keep = truncation_size(keep, max_input_tokens, limit_name)
    side = side or "left"
    if side not in ("left", "right"):
        raise ValueError(f"truncation_side must be 'left' or 'right', got {side!r}")
    if not isinstance(prompt, str):
        ids = list(prompt)
        if keep is None or len(ids) <= keep:
            return ids, False
        return (ids[-keep:] if side == "left" else ids[:keep]), True
    special = {} if add_special_tokens else {"add_special_tokens": False}
    ids = list(tokenizer.encode(prompt, **special))
    if keep is None or len(ids) <= keep:  # the tokenizer's truncation would change nothing
        return ids, False
    # The tokenizer's own side may differ (transformers' default is right, load_tokenizer's
    # left): switched for this call only. Tokenizer calls run on one thread (the engine's
    # tokenizer worker, the router's), so no other call sees the switch.
    own = getattr(tokenizer, "truncation_side", "left")
    if own != side:
        tokenizer.truncation_side = side
    try:
        return list(tokenizer.encode(prompt, truncation=True, max_length=keep, **special)), True
    finally:
        if own != side:
            tokenizer.truncation_side = own


def resolve_max_logprobs(max_logprobs: int, vocab_size: int) -> int:
    """EngineConfig.max_logprobs as a number: -1 is the whole vocabulary, and no more than that
    can be asked for whatever the flag says (the sampler's top-N is over the vocabulary)."""
    return vocab_size if max_logprobs == -1 else min(max_logprobs, vocab_size)


class InputProcessor:
    def __init__(self, tokenizer: Any | None, vocab_size: int, max_model_len: int, max_num_seqs: int,
                 cache_config: CacheConfig, max_logprobs: int = 20, eos_token_ids: Iterable[int] = ()) -> None:
        self.tokenizer, self.vocab_size, self.max_model_len = tokenizer, vocab_size, max_model_len
        self.eos_token_ids = frozenset(eos_token_ids)  # what min_tokens holds back, with stop_token_ids
        self.max_num_seqs, self.cache_config = max_num_seqs, cache_config
        self.max_logprobs = resolve_max_logprobs(max_logprobs, vocab_size)

    def prompt_ids(self, prompt: str | list[int] | dict,
                   truncate_prompt_tokens: int | None = None) -> tuple[str | None, list[int]]:
        """(text or None, the ids that run: cut to truncate_prompt_tokens, see truncated_prompt)."""
        text, ids = split_prompt(prompt, can_tokenize=self.tokenizer is not None)
        if ids is not None and not ids:
            raise ValueError("prompt must not be empty (prompt_token_ids is [])")
        ids, _ = truncated_prompt(self.tokenizer, text if ids is None else ids, truncate_prompt_tokens,
                                  self.max_model_len)
        return text, ids

    def check_token_ids(self, name: str, ids: Iterable[int]) -> None:
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"{name} must be in [0, {self.vocab_size}) (the model's vocab), got {bad[:5]}")

    def check_something_to_draw(self, params: SamplingParams) -> None:
        """allowed_token_ids must leave a token to draw. A one-token bad word is banned at every
        step, and min_tokens holds back the stop tokens for its first tokens: with nothing left,
        every logit is -inf, the softmax NaN, and each draw took token 0."""
        left = set(params.allowed_token_ids) - {w[0] for w in params.bad_words_token_ids or () if len(w) == 1}
        if not left:
            raise ValueError("allowed_token_ids: bad_words bans every one of them, leaving no token to draw")
        stops = set(params.stop_token_ids) | (set() if params.ignore_eos else self.eos_token_ids)
        if params.min_tokens and not left - stops:
            raise ValueError(f"allowed_token_ids: all of them end the output (EOS or stop_token_ids), which "
                             f"min_tokens ({params.min_tokens}) holds back: no token is left to draw")

    def logprob_count(self, name: str, asked: int | None) -> int | None:
        """A request's logprobs count (named `name`) as a number, vLLM's -1 being the whole
        vocabulary; more than max_logprobs is a ValueError."""
        k = self.vocab_size if asked == -1 else asked
        if k is not None and k > self.max_logprobs:
            shown = f"-1: the whole vocabulary, {k}" if asked == -1 else k
            raise ValueError(f"{name} ({shown}) must be <= max_logprobs ({self.max_logprobs}, the engine's "
                             "--max-logprobs)")
        return k

    def process(self, prompt: Any, params: SamplingParams) -> tuple[str | None, list[int], SamplingParams]:
        """(prompt text or None, prompt token ids, params with max_tokens resolved)."""
        # Cut before every check: the length limits and the vocabulary apply to what runs (vLLM's).
        text, ids = self.prompt_ids(prompt, params.truncate_prompt_tokens)
        self.check_token_ids("prompt_token_ids", ids)
        self.check_token_ids("stop_token_ids", params.stop_token_ids)
        self.check_token_ids("logit_bias", params.logit_bias or ())
        self.check_token_ids("allowed_token_ids", params.allowed_token_ids or ())
        self.check_token_ids("bad_words", [t for w in params.bad_words_token_ids or () for t in w])
        if params.allowed_token_ids is not None:
            self.check_something_to_draw(params)
        for name in ("logprobs", "prompt_logprobs"):
            asked = getattr(params, name)
            if asked == -1:
                params = dataclasses.replace(params, **{name: self.logprob_count(name, asked)})
            else:
                self.logprob_count(name, asked)
        if params.best_of > self.max_num_seqs:
            raise ValueError(f"best_of ({params.best_of}) must be <= max_num_seqs ({self.max_num_seqs})")
        if len(ids) >= self.max_model_len:
            raise ValueError(f"prompt length ({len(ids)} tokens) must be < max_model_len ({self.max_model_len})")
        if params.max_tokens is None:
            params = dataclasses.replace(params, max_tokens=self.max_model_len - len(ids))
        elif len(ids) + params.max_tokens > self.max_model_len:
            raise ValueError(
                f"prompt length ({len(ids)} tokens) + max_tokens ({params.max_tokens}) must be <= "
                f"max_model_len ({self.max_model_len})")
        capacity = self.cache_config.num_gpu_blocks * self.cache_config.block_size
        if self.cache_config.kv_allocator == "paged" and len(ids) + params.max_tokens > capacity:
            # It could never run to the end, even alone: reject it now, not halfway through.
            raise ValueError(
                f"prompt length ({len(ids)} tokens) + max_tokens ({params.max_tokens}) must fit in the KV "
                f"cache ({capacity} token slots = num_gpu_blocks {self.cache_config.num_gpu_blocks} x "
                f"block_size {self.cache_config.block_size})")
        if self.cache_config.kv_allocator == "paged" and params.best_of > 1:
            self.check_forks_fit(len(ids), params)
        return text, ids, params

    def check_forks_fit(self, prompt_len: int, params: SamplingParams) -> None:
        """best_of sequences fork from the prompt and share its full blocks; past them each needs
        its own blocks for the rest of its tokens. A group whose peak outgrows the whole cache would
        have every sequence cut short ("length", core/scheduler.py _finish_full): refused now."""
        bs, num_blocks = self.cache_config.block_size, self.cache_config.num_gpu_blocks
        shared = prompt_len // bs
        need = shared + params.best_of * (-(-(prompt_len + params.max_tokens) // bs) - shared)
        if need > num_blocks:
            raise ValueError(
                f"best_of ({params.best_of}) sequences of prompt length ({prompt_len} tokens) + max_tokens "
                f"({params.max_tokens}) need up to {need} KV-cache blocks (the prompt's {shared} full blocks "
                f"shared), more than the cache's {num_blocks} (block_size {bs}): lower n / best_of or max_tokens")
