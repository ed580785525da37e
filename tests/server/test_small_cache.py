"""A server whose whole KV cache is 8 blocks: requests that can never fit are 400s, and
requests that fit only one or two at a time are preempted and still finish, unchanged."""
from __future__ import annotations

import asyncio

import httpx
import openai
import pytest

from server_process import start_server, stop_server

NUM_BLOCKS, BLOCK_SIZE = 8, 16


@pytest.fixture(scope="module")
def small(tiny_model_dir, tmp_path_factory):
    s = start_server(tiny_model_dir("llama"), tmp_path_factory.mktemp("small") / "server.log",
                     "--max-model-len", "512", "--num-gpu-blocks-override", str(NUM_BLOCKS),
                     "--block-size", str(BLOCK_SIZE), "--swap-space", "0.05")
    yield s
    stop_server(s)


@pytest.mark.parametrize("body,param", [
    ({"prompt": [7] * 20, "max_tokens": 200}, "max_tokens"),
    ({"prompt": [7] * 200, "max_tokens": 2}, "prompt"),
    ({"prompt": [7] * 20, "max_tokens": 40, "n": 4, "temperature": 1}, "n"),
])
def test_request_larger_than_the_cache_is_400(small, body, param):
    r = httpx.post(small.v1 + "/completions", json={"model": small.model, **body}, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["code"] == "kv_cache_capacity_exceeded"
    assert str(NUM_BLOCKS) in err["message"]


def test_chat_without_max_tokens_fits_the_cache(small):
    client = openai.OpenAI(base_url=small.v1, api_key="unused", max_retries=0, timeout=120)
    r = client.chat.completions.create(model=small.model, messages=[{"role": "user", "content": "hi"}],
                                       temperature=0, extra_body={"ignore_eos": True})
    assert r.choices[0].finish_reason == "length"
    assert r.usage.total_tokens <= NUM_BLOCKS * BLOCK_SIZE


def test_memory_pressure_preempts_but_outputs_do_not_change(small):
    """Each request needs 4 of the 8 blocks; six at once must take turns (preemption)."""
    prompts = [[(11 * i + j) % 300 + 3 for j in range(10)] for i in range(6)]
    kw = dict(model=small.model, max_tokens=50, temperature=0, extra_body={"ignore_eos": True})
    client = openai.OpenAI(base_url=small.v1, api_key="unused", max_retries=0, timeout=120)
    alone = [client.completions.create(prompt=p, **kw).choices[0].text for p in prompts]
    before = small.metrics()["pagedserve:num_preemptions_total"]

    async def together():
        ac = openai.AsyncOpenAI(base_url=small.v1, api_key="unused", max_retries=0, timeout=300)
        try:
            return await asyncio.gather(*(ac.completions.create(prompt=p, **kw) for p in prompts))
        finally:
            await ac.close()

    results = asyncio.run(together())
    assert [r.choices[0].text for r in results] == alone
    assert all(r.usage.completion_tokens == 50 for r in results)
    m = small.metrics()
    assert m["pagedserve:num_preemptions_total"] > before
    assert m["pagedserve:num_requests_running"] == 0 and m["pagedserve:kv_cache_usage_perc"] == 0
