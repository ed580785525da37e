"""The server names logprob tokens as vLLM's does: each Logprob's decoded_token (vLLM's
_get_decoded_token), so a character split across byte-level tokens is named by the token that
completes it, not as U+FFFD by every piece. Reference: tests/logprob_reference.vllm_name over the
HF tokenizer's decode; the ids come from the same greedy request with return_tokens_as_token_ids."""
import json

import pytest
from transformers import AutoTokenizer

from logprob_reference import vllm_name

TEXT = "日本語🔥"  # every byte-level token of it ends mid-character (decode([id]) == "\ufffd")
FORCED = {"structured_outputs": {"choice": [TEXT]}, "temperature": 0}


@pytest.fixture(scope="module")
def tok(server):
    return AutoTokenizer.from_pretrained(server.model_dir)


def _post(http, path, body, stream):
    if not stream:
        r = http.post(path, json=body)
        assert r.status_code == 200, r.text
        return [r.json()]
    chunks = []
    with http.stream("POST", path, json={**body, "stream": True}) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[6:]))
    return chunks


def _id(name):
    assert name.startswith("token_id:"), name
    return int(name[len("token_id:"):])


def _completion(http, server, stream, as_ids):
    body = {"model": server.model, "prompt": TEXT, "max_tokens": 12, "echo": True, "logprobs": 2,
            "return_tokens_as_token_ids": as_ids, **FORCED}
    out = {"tokens": [], "top": [], "text": ""}
    for c in _post(http, "/v1/completions", body, stream):
        for ch in c["choices"]:
            out["text"] += ch["text"]
            if ch["logprobs"]:
                out["tokens"] += ch["logprobs"]["tokens"]
                out["top"] += ch["logprobs"]["top_logprobs"]
    return out


@pytest.mark.parametrize("stream", [False, True])
def test_completion_tokens_are_vllms_decoded_tokens(http, server, tok, stream):
    ids_run, named = _completion(http, server, stream, True), _completion(http, server, stream, False)
    prompt = tok(TEXT).input_ids
    ids = [_id(t) for t in ids_run["tokens"]]
    assert ids[:len(prompt)] == prompt and named["text"] == TEXT + TEXT
    out = ids[len(prompt):]
    assert tok.decode(out) == TEXT
    # The prompt's context starts at its position 1 (vLLM's prompt logprobs), the output's at its own start.
    contexts = [prompt[max(1, i - 4):i] for i in range(len(prompt))] + [out[max(0, i - 4):i] for i in range(len(out))]
    want = [tok.decode([ids[0]])] + [vllm_name(tok, t, c) for t, c in zip(ids[1:], contexts[1:])]
    assert named["tokens"] == want
    assert any(w != tok.decode([t]) for w, t in zip(want, ids))  # the case per-id decode gets wrong
    assert "".join(named["tokens"][len(prompt):]) == TEXT
    for top_ids, top_named, ctx in zip(ids_run["top"][1:], named["top"][1:], contexts[1:]):
        # keyed by name, as vLLM's dict: tokens named alike (two partial bytes: "") share a key
        assert top_named == {vllm_name(tok, _id(k), ctx): v for k, v in top_ids.items()}


def _chat(http, server, stream, as_ids):
    body = {"model": server.model, "messages": [{"role": "user", "content": "fire"}], "max_tokens": 12,
            "logprobs": True, "top_logprobs": 2, "return_tokens_as_token_ids": as_ids, **FORCED}
    content, text = [], ""
    for c in _post(http, "/v1/chat/completions", body, stream):
        for ch in c["choices"]:
            text += (ch.get("message") or ch.get("delta")).get("content") or ""
            if ch.get("logprobs"):
                content += ch["logprobs"]["content"]
    return content, text


@pytest.mark.parametrize("stream", [False, True])
def test_chat_tokens_and_bytes_are_vllms_decoded_tokens(http, server, tok, stream):
    (ids_content, _), (named, text) = _chat(http, server, stream, True), _chat(http, server, stream, False)
    assert text == TEXT
    ids = [_id(e["token"]) for e in ids_content]
    assert tok.decode(ids) == TEXT
    for i, (by_id, e) in enumerate(zip(ids_content, named)):
        ctx = ids[max(0, i - 4):i]
        assert e["token"] == vllm_name(tok, ids[i], ctx)
        assert e["bytes"] == list(e["token"].encode("utf-8"))
        assert [t["token"] for t in e["top_logprobs"]] == [vllm_name(tok, _id(t["token"]), ctx)
                                                          for t in by_id["top_logprobs"]]
        assert all(t["bytes"] == list(t["token"].encode("utf-8")) for t in e["top_logprobs"])
    assert "".join(e["token"] for e in named) == TEXT  # per-id decode would give a run of U+FFFD


# vLLM's decoded_token of each piece (convert_ids_list_to_tokens: decode([id]), then the spaces
# of the leading "▁"s that decode drops put back); decode([id]) alone gives "true" for both.
METASPACE_NAMES = {1: " true", 2: "true", 3: "  x", 4: "x"}


@pytest.fixture(scope="module")
def ms_server(tiny_model_dir, tmp_path_factory):
    from detok_reference import metaspace_tokenizer, model_with_tokenizer
    from server_process import start_server, stop_server
    d = model_with_tokenizer(tiny_model_dir("llama"), tmp_path_factory.mktemp("metaspace-model"),
                             metaspace_tokenizer())
    s = start_server(d, tmp_path_factory.mktemp("ms-server") / "server.log", "--max-model-len", "256")
    yield s
    stop_server(s)


@pytest.mark.parametrize("stream", [False, True])
def test_sentencepiece_leading_spaces_in_server_names(ms_server, stream):
    import httpx
    tok = AutoTokenizer.from_pretrained(ms_server.model_dir)
    assert tok.decode([1]) == tok.decode([2]) == "true"
    forced = {"model": "tiny", "max_tokens": 12, "temperature": 1.0, "seed": 3, "ignore_eos": True,
              "allowed_token_ids": list(METASPACE_NAMES)}
    with httpx.Client(base_url=ms_server.base_url, timeout=120) as http:
        cmpl = {**forced, "prompt": [1, 4], "logprobs": 0}
        ids = [_id(t) for t in _completion_tokens(http, {**cmpl, "return_tokens_as_token_ids": True}, stream)]
        assert {1, 2} & set(ids), ids  # the seed draws the pieces decode([id]) cannot tell apart
        assert _completion_tokens(http, cmpl, stream) == [METASPACE_NAMES[t] for t in ids]
        chat = {**forced, "messages": [{"role": "user", "content": "x"}], "logprobs": True}
        by_id = _chat_entries(http, {**chat, "return_tokens_as_token_ids": True}, stream)
        named = _chat_entries(http, chat, stream)
        assert [e["token"] for e in named] == [METASPACE_NAMES[_id(e["token"])] for e in by_id]
        assert all(e["bytes"] == list(e["token"].encode()) for e in named)


def _completion_tokens(http, body, stream):
    return [t for c in _post(http, "/v1/completions", body, stream) for ch in c["choices"]
            for t in (ch["logprobs"] or {}).get("tokens", [])]


def _chat_entries(http, body, stream):
    return [e for c in _post(http, "/v1/chat/completions", body, stream) for ch in c["choices"]
            for e in (ch.get("logprobs") or {}).get("content") or []]
