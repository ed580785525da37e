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
