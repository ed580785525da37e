"""The OpenAI server with a model whose generation_config.json sets temperature 0 and
max_new_tokens 6 (engine/generation_defaults.py): requests that leave them unset get them,
as vLLM's do; a request's own values win."""
from __future__ import annotations

import httpx
import pytest

from engine.helpers import hf_greedy, make_llm, model_with_generation_config
from pagedserve.demo_model import DEMO_MODEL_DIR
from pagedserve.sampling_params import SamplingParams
from server_process import start_server, stop_server

PROMPT = "In the beginning God created"


@pytest.fixture(scope="module")
def http(tmp_path_factory):
    m = model_with_generation_config(tmp_path_factory.mktemp("gen-model"), temperature=0.0, max_new_tokens=6)
    s = start_server(m, tmp_path_factory.mktemp("gen-defaults") / "server.log", "--max-model-len", "256",
                     "--num-gpu-blocks-override", "64", "--max-num-seqs", "8", "--swap-space", "0.05")
    with httpx.Client(base_url=s.base_url, timeout=120) as c:
        yield c
    stop_server(s)


@pytest.fixture(scope="module")
def llm():
    return make_llm(DEMO_MODEL_DIR)


def complete(http, **kw) -> dict:
    r = http.post("/v1/completions", json={"model": "tiny", "prompt": PROMPT, **kw})
    assert r.status_code == 200, r.text
    return r.json()


def offline_text(llm, params: SamplingParams) -> tuple[list[int], str]:
    out = llm.generate(PROMPT, params, use_tqdm=False)[0].outputs[0]
    return list(out.token_ids), out.text


def test_unset_fields_take_the_generation_config(http, llm):
    ids = llm.get_tokenizer()(PROMPT).input_ids
    tokens, text = offline_text(llm, SamplingParams(temperature=0.0, max_tokens=6))
    assert tokens == hf_greedy(DEMO_MODEL_DIR, ids, 6)
    body = complete(http)
    assert body["choices"][0]["text"] == text and body["usage"]["completion_tokens"] == len(tokens)
    chat = http.post("/v1/chat/completions", json={"model": "tiny", "messages": [{"role": "user", "content": "Hi"}]})
    assert chat.status_code == 200 and chat.json()["usage"]["completion_tokens"] <= 6, chat.text


def test_a_requests_own_values_win(http, llm):
    assert complete(http, max_tokens=9, ignore_eos=True)["usage"]["completion_tokens"] == 9
    params = dict(temperature=1.5, seed=3, max_tokens=8, ignore_eos=True)
    _, text = offline_text(llm, SamplingParams(**params))
    assert complete(http, **params)["choices"][0]["text"] == text
