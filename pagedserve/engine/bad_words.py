"""vLLM's bad_words: words a request must not generate.

Each word is tokenized twice, as it would start the text and as it would follow a space (the
second kept only where the space makes a different first token but as many tokens: a tokenizer
without a word-start marker gives nothing new). A one-token word is never drawn; for a longer one,
its last token is not drawn right after the output ends with the tokens before it. Only output
tokens count (a word the prompt starts may still be finished), as vLLM's.

The longer words read the newest output token on the host, so their requests take synchronous
steps (step_pipeline.overlaps); one-token words are a fixed mask and overlap as any request.
"""
from __future__ import annotations

import dataclasses
from typing import Any

from pagedserve.sampling_params import SamplingParams


def tokenize_bad_words(words: list[str], tokenizer: Any) -> list[list[int]]:
    out: list[list[int]] = []
    for word in words:
        bare = tokenizer.encode(word.lstrip(), add_special_tokens=False)
        if not bare:
            continue
        out.append(bare)
        spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
        if spaced and spaced[0] != bare[0] and len(spaced) == len(bare):
            out.append(spaced)
    return out


def with_bad_word_ids(params: SamplingParams, tokenizer: Any) -> SamplingParams:
    """params with bad_words_token_ids filled from bad_words (where the tokenizer lives: the
    API process, or the engine offline)."""
    if not params.bad_words or params.bad_words_token_ids is not None:
        return params
    if tokenizer is None:
        raise ValueError("bad_words needs a tokenizer (this engine was started with skip_tokenizer_init)")
    return dataclasses.replace(params, bad_words_token_ids=tokenize_bad_words(params.bad_words, tokenizer))


def needs_host_tail(params: SamplingParams) -> bool:
    """Whether some bad word is longer than one token (its ban depends on the newest output)."""
    return any(len(w) > 1 for w in params.bad_words_token_ids or ())


def banned_tokens(params: SamplingParams, output: list[int]) -> list[int]:
    """The tokens the next draw must not take, given the output so far."""
    banned = []
    for word in params.bad_words_token_ids or ():
        k = len(word) - 1
        if k == 0 or (len(output) >= k and output[len(output) - k:] == word[:k]):
            banned.append(word[-1])
    return banned
