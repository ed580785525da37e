"""A text prompt whose tokenizer gives no ids (add_special_tokens=false takes away the BOS that
would otherwise be there) is a 400 naming the prompt, not an empty request for the engine."""
from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from pagedserve.entrypoints.openai.protocol import CompletionRequest
from pagedserve.entrypoints.openai.serving_common import APIError
from pagedserve.entrypoints.openai.serving_completion import OpenAIServingCompletion


class SpaceEatingTokenizer:
    """Whitespace is no token; a BOS (id 1) is added unless add_special_tokens=False."""

    def get_vocab(self):  # (the server bounds a text's length by its tokens' longest text)
        return {chr(i): i for i in range(32, 127)}

    def encode(self, text, add_special_tokens=True, **_):
        ids = [ord(c) for c in text if not c.isspace()]
        return ([1] if add_special_tokens else []) + ids


async def run(fn, *args, **kw):
    return fn(*args, **kw)


@pytest.mark.parametrize("special", [True, False])
def test_a_prompt_of_no_tokens_is_a_400(special):
    server = OpenAIServingCompletion(SimpleNamespace(tokenizer=SpaceEatingTokenizer(), run=run,
                                                     max_model_len=64, vocab_size=1000), "m")
    req = CompletionRequest.model_validate({"prompt": "   ", "add_special_tokens": special})
    if special:
        assert asyncio.run(server._prompts(req, None))[0].token_ids == [1]
        return
    with pytest.raises(APIError) as e:
        asyncio.run(server._prompts(req, None))
    assert e.value.param == "prompt" and "no tokens" in e.value.message
