"""spaces_between_special_tokens on the server, as vLLM's: false (with skip_special_tokens false)
drops the spaces a WordPiece decoder puts between added tokens, in completions and chat, streamed
or not; the reference is vLLM's fast detokenizer rule over tokenizers' DecodeStream
(tests/detok_reference.py), the token ids taken from the same seeded request's logprobs."""
import json

import pytest
from transformers import AutoTokenizer

from detok_reference import vllm_fast_text, wordpiece_model
from server_process import start_server, stop_server

ADDED_AND_WORDS = [1, 2, 4, 5, 8]  # [CLS] [SEP] world ##s <tool>


@pytest.fixture(scope="module")
def wp_server(tiny_model_dir, tmp_path_factory):
    d = wordpiece_model(tiny_model_dir("llama"), tmp_path_factory.mktemp("wordpiece-model"))
    s = start_server(d, tmp_path_factory.mktemp("wp-server") / "server.log", "--max-model-len", "256")
    yield s
    stop_server(s)


@pytest.fixture(scope="module")
def wp_http(wp_server):
    import httpx
    with httpx.Client(base_url=wp_server.base_url, timeout=120) as c:
        yield c


def _run(http, path, body, stream):
    """(text, token ids) of the one choice; ids from logprobs named token_id:N."""
    body = {**body, "model": "tiny", "stream": stream, "return_tokens_as_token_ids": True}
    if not stream:
        r = http.post(path, json=body)
        assert r.status_code == 200, r.text
        chunks = [r.json()]
    else:
        with http.stream("POST", path, json=body) as r:
            assert r.status_code == 200
            chunks = [json.loads(line[6:]) for line in r.iter_lines()
                      if line.startswith("data: ") and line != "data: [DONE]"]
    text, ids = "", []
    for c in chunks:
        for ch in c["choices"]:
            if "text" in ch:
                text += ch["text"]
                ids += [int(t[9:]) for t in (ch["logprobs"] or {}).get("tokens", [])]
            else:
                text += (ch.get("message") or ch.get("delta")).get("content") or ""
                ids += [int(e["token"][9:]) for e in (ch.get("logprobs") or {}).get("content") or []]
    return text, ids


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("spaces", [True, False])
def test_completion_text_as_vllm(wp_http, wp_server, stream, spaces):
    tok = AutoTokenizer.from_pretrained(wp_server.model_dir)
    prompt = [3, 4]
    body = {"prompt": prompt, "max_tokens": 10, "temperature": 0.8, "seed": 7, "ignore_eos": True,
            "logprobs": 0, "skip_special_tokens": False, "allowed_token_ids": ADDED_AND_WORDS,
            "spaces_between_special_tokens": spaces}
    text, ids = _run(wp_http, "/v1/completions", body, stream)
    assert len(ids) == 10 and text == vllm_fast_text(tok, prompt, ids, False, spaces)
    if not spaces:
        assert text != vllm_fast_text(tok, prompt, ids, False, True)  # added tokens in a row


def test_chat_text_as_vllm(wp_http, wp_server):
    tok = AutoTokenizer.from_pretrained(wp_server.model_dir)
    body = {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 10, "temperature": 0.8,
            "seed": 7, "ignore_eos": True, "logprobs": True, "skip_special_tokens": False,
            "allowed_token_ids": ADDED_AND_WORDS, "spaces_between_special_tokens": False}
    for stream in (False, True):
        r = wp_http.post("/tokenize", json={"model": "tiny", "messages": body["messages"]})
        assert r.status_code == 200, r.text
        prompt = r.json()["tokens"]
        text, ids = _run(wp_http, "/v1/chat/completions", body, stream)
        assert len(ids) == 10 and text == vllm_fast_text(tok, prompt, ids, False, False)
