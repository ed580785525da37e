"""The streamed completion chunks' direct encoder writes exactly what the pydantic models
would (sse(CompletionResponse(...))), for any text, index and finish reason."""
from __future__ import annotations

import random

import pytest

from pagedserve.entrypoints.openai import serving_completion
from pagedserve.entrypoints.openai.protocol import CompletionChoice, CompletionResponse
from pagedserve.entrypoints.openai.serving_common import sse
from pagedserve.entrypoints.openai.serving_completion import CompletionChunkEncoder

TEXTS = ["", " the", 'quote " and \\ backslash', "new\nline\ttab\r", "\x00\x01\x1f\x7f",
         "é ü 中文 🙂", "\u2028\u2029", "</script>", "\ufffd", "a" * 300]


CREATED = 1796031195


@pytest.fixture(autouse=True)
def fixed_clock(monkeypatch):
    monkeypatch.setattr(serving_completion, "now", lambda: CREATED)


def _reference(rid, model, choices):
    return sse(CompletionResponse(id=rid, model=model, created=CREATED, choices=[
        CompletionChoice(index=i, text=t, logprobs=None, finish_reason=f, stop_reason=s) for i, t, f, s in choices]))


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("finish,stop", [(None, None), ("length", None), ("stop", None), ("stop", 7),
                                         ("stop", 'a "stop"\n'), ("abort", None)])
def test_one_choice_matches_the_model(text, finish, stop):
    enc = CompletionChunkEncoder("cmpl-0123abcd", "bench")
    assert enc.encode([(0, text, finish, stop)]) == _reference("cmpl-0123abcd", "bench", [(0, text, finish, stop)])


def test_many_choices_odd_names_and_random_text_match_the_model():
    rng = random.Random(0)
    alphabet = [chr(c) for c in range(0, 0x250)] + ["🙂", "中", "\ud7ff", "\ue000", '"', "\\"]
    for model in ("bench", 'my "model"/ü', "/models/llama-3.1-8b"):
        enc = CompletionChunkEncoder("cmpl-x", model)
        for _ in range(200):
            choices = [(rng.randrange(8), "".join(rng.choices(alphabet, k=rng.randrange(12))),
                        rng.choice([None, "length", "stop"]), rng.choice([None, 2, "\n"]))
                       for _ in range(rng.randrange(1, 4))]
            assert enc.encode(choices) == _reference("cmpl-x", model, choices)
