"""The JSON-schema checks of a request (jsonschema's meta-schema check: ~300 ms for a 47 KB
schema) run on the engine's worker thread, not on the event loop, where they stalled every
stream of the server for as long."""
from __future__ import annotations

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from pagedserve.entrypoints.openai import structured_outputs, tools
from pagedserve.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
from pagedserve.entrypoints.openai.serving_chat import OpenAIServingChat
from pagedserve.entrypoints.openai.serving_common import APIError

SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}


class WorkerEngine:
    """What the handlers use of AsyncLLMEngine: run() on a worker thread, and the limits."""
    tokenizer = None  # rendering the chat stops there, with an APIError
    max_num_seqs, max_logprobs, vocab_size, max_model_len = 8, 20, 100, 512

    def __init__(self) -> None:
        self.pool = ThreadPoolExecutor(1)

    async def run(self, fn, *args, **kwargs):
        return await asyncio.get_running_loop().run_in_executor(self.pool, lambda: fn(*args, **kwargs))


def _spy(monkeypatch, module) -> list[int]:
    threads: list[int] = []
    real = structured_outputs.check_json_schema

    def spy(schema, param):
        threads.append(threading.get_ident())
        return real(schema, param)
    monkeypatch.setattr(module, "check_json_schema", spy)
    return threads


def test_a_completions_schema_is_checked_off_the_loop(monkeypatch):
    threads = _spy(monkeypatch, structured_outputs)
    req = CompletionRequest(prompt="a", guided_json=SCHEMA)

    async def main():
        return threading.get_ident(), await structured_outputs.resolve_structured_outputs(WorkerEngine(), req)
    loop_thread, (params, param) = asyncio.run(main())
    assert params.json == SCHEMA and param == "guided_json"
    assert threads and loop_thread not in threads


def test_tool_schemas_are_checked_off_the_loop(monkeypatch):
    threads = _spy(monkeypatch, tools)
    req = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], tool_choice="required", tools=[
        {"type": "function", "function": {"name": "weather", "parameters": SCHEMA}}])
    chat = OpenAIServingChat(WorkerEngine(), "tiny")

    async def main():
        with pytest.raises(APIError, match="chat template"):  # (the fake engine has no tokenizer)
            await chat.create(req, None)
        return threading.get_ident()
    loop_thread = asyncio.run(main())
    assert threads and loop_thread not in threads


class CountingEngine(WorkerEngine):
    def __init__(self) -> None:
        super().__init__()
        self.hops = 0

    async def run(self, fn, *args, **kwargs):
        self.hops += 1
        return await super().run(fn, *args, **kwargs)


def test_a_request_without_a_constraint_takes_no_hop_and_keeps_its_field_checks():
    """Most requests ask for no constraint: they wait on no worker-thread round trip (queued
    behind other requests' tokenization), and a field that needs a constraint is still a 400."""
    engine = CountingEngine()
    plain = CompletionRequest(prompt="a")
    assert asyncio.run(structured_outputs.resolve_structured_outputs(engine, plain)) is None
    assert engine.hops == 0
    alone = CompletionRequest(prompt="a", guided_whitespace_pattern=" ")
    with pytest.raises(APIError) as e:
        asyncio.run(structured_outputs.resolve_structured_outputs(engine, alone))
    assert e.value.param == "guided_whitespace_pattern" and engine.hops == 0
    constrained = CompletionRequest(prompt="a", guided_json=SCHEMA)
    params, param = asyncio.run(structured_outputs.resolve_structured_outputs(engine, constrained))
    assert params.json == SCHEMA and param == "guided_json"
    assert engine.hops == 1
