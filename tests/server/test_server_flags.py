"""vLLM's logging and logprob `serve` flags on a real server: --enable-log-requests (a line per
request), --return-tokens-as-token-ids (the default a request may override) and
--uvicorn-log-level (warning: no access lines), --max-logprobs (a request's bound) and
--chat-template-content-format (openai: the template gets a message's list of parts)."""
from __future__ import annotations

import json

import httpx
import pytest

from server_process import start_server, stop_server


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    s = start_server(tiny_model_dir("llama"), tmp_path_factory.mktemp("flags") / "server.log", "--max-model-len", "256",
                     "--num-gpu-blocks-override", "64", "--max-num-seqs", "8", "--swap-space", "0.05",
                     "--enable-log-requests", "--return-tokens-as-token-ids", "--uvicorn-log-level", "warning",
                     "--max-logprobs", "2", "--chat-template-content-format", "openai",
                     "--scheduling-policy", "priority", "--enable-prompt-tokens-details")
    yield s
    stop_server(s)


def _tokens(server, **kw) -> list[str]:
    with httpx.Client(base_url=server.base_url, timeout=120) as c:
        r = c.post("/v1/completions", json={"model": "tiny", "prompt": [5, 17, 33], "max_tokens": 3, "logprobs": 1,
                                            "temperature": 0, **kw})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["logprobs"]["tokens"]


def test_tokens_as_ids_by_default_and_a_request_may_say_otherwise(server):
    as_ids = _tokens(server)
    assert len(as_ids) == 3 and all(t.startswith("token_id:") and t[9:].isdigit() for t in as_ids)
    as_text = _tokens(server, return_tokens_as_token_ids=False)
    assert len(as_text) == 3 and not any(t.startswith("token_id:") for t in as_text)


def test_each_request_logged_and_no_access_lines(server):
    _tokens(server)
    log = server.log()
    assert "3 prompt tokens, SamplingParams(" in log and "request cmpl-" in log
    assert '"POST /v1/completions' not in log


def test_max_logprobs_bounds_each_request_by_the_field_it_names(server):
    with httpx.Client(base_url=server.base_url, timeout=120) as c:
        ok = c.post("/v1/completions", json={"model": "tiny", "prompt": [5, 17], "max_tokens": 2, "logprobs": 2})
        assert ok.status_code == 200, ok.text
        assert all(len(top) >= 2 for top in ok.json()["choices"][0]["logprobs"]["top_logprobs"])
        for path, body, param in (
                ("/v1/completions", {"prompt": [5, 17], "logprobs": 3}, "logprobs"),
                ("/v1/completions", {"prompt": [5, 17], "logprobs": 3, "echo": True}, "logprobs"),
                ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "logprobs": True,
                                          "top_logprobs": 3}, "top_logprobs")):
            r = c.post(path, json={"model": "tiny", "max_tokens": 2, **body})
            assert r.status_code == 400, r.text
            err = r.json()["error"]
            assert err["param"] == param and "<= 2 (the server's --max-logprobs), got 3" in err["message"], err
        # vLLM's -1 (the whole vocabulary) is bounded like any number; completions' logprobs take no -1
        for path, body, param in (
                ("/v1/completions", {"prompt": [5, 17], "prompt_logprobs": -1}, "prompt_logprobs"),
                ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "prompt_logprobs": -1},
                 "prompt_logprobs"),
                ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "logprobs": True,
                                          "top_logprobs": -1}, "top_logprobs")):
            r = c.post(path, json={"model": "tiny", "max_tokens": 2, **body})
            assert r.status_code == 400, r.text
            err = r.json()["error"]
            assert err["param"] == param, err
            assert "<= 2 (the server's --max-logprobs), got -1 (the whole vocabulary, " in err["message"], err
        for body, param in (({"logprobs": -1}, "logprobs"), ({"prompt_logprobs": -2}, "prompt_logprobs")):
            r = c.post("/v1/completions", json={"model": "tiny", "max_tokens": 2, "prompt": [5, 17], **body})
            assert r.status_code == 400 and param in r.text, r.text
        assert c.get("/health").status_code == 200


def test_content_format_openai_hands_the_template_the_parts(server):
    """The tiny model's template prints m['content']: with --chat-template-content-format openai
    that is the list of parts, exactly as HF renders the same list."""
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(server.model_dir)
    msgs = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]
    with httpx.Client(base_url=server.base_url, timeout=120) as c:
        r = c.post("/tokenize", json={"model": "tiny", "messages": msgs})
    assert r.status_code == 200, r.text
    text = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    assert "'text': 'b'" in text
    assert r.json()["tokens"] == tok(text, add_special_tokens=False).input_ids


def test_logit_bias_and_allowed_token_ids_are_honoured(server):
    """(They were a 400 before.) A +100 bias takes every draw; allowed_token_ids bounds them."""
    with httpx.Client(base_url=server.base_url, timeout=120) as c:
        r = c.post("/v1/completions", json={"model": "tiny", "prompt": [5, 17], "max_tokens": 4, "temperature": 1.0,
                                            "logit_bias": {"7": 100}, "logprobs": 0})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["logprobs"]["tokens"] == ["token_id:7"] * 4
        r = c.post("/v1/chat/completions", json={
            "model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 6, "temperature": 1.0,
            "seed": 1, "allowed_token_ids": [11, 12], "logprobs": True, "top_logprobs": 0})
        assert r.status_code == 200, r.text
        tokens = [t["token"] for t in r.json()["choices"][0]["logprobs"]["content"]]
        assert len(tokens) == 6 and set(tokens) <= {"token_id:11", "token_id:12"}


def test_cache_salt_keeps_tenants_apart(server):
    """A request's cache_salt (vLLM's): the same prompt under another salt reuses nothing."""
    prompt = list(range(5, 5 + 33))

    def cached(**kw) -> int:
        before = server.metrics()["vllm:prefix_cache_hits_total"]
        with httpx.Client(base_url=server.base_url, timeout=120) as c:
            r = c.post("/v1/completions", json={"model": "tiny", "prompt": prompt, "max_tokens": 1, **kw})
        assert r.status_code == 200, r.text
        return server.metrics()["vllm:prefix_cache_hits_total"] - before
    assert cached(cache_salt="t1") == 0
    assert cached(cache_salt="t2") == 0
    assert cached(cache_salt="t1") == 32


def test_priority_reaches_the_priority_scheduler(server):
    """Under --scheduling-policy priority a request's priority is taken (under fcfs: a 400,
    tests/server/test_bad_input.py); the order it gives is tests/engine/test_batch_defaults.py's."""
    with httpx.Client(base_url=server.base_url, timeout=120) as c:
        for priority in (-3, 5):
            r = c.post("/v1/chat/completions", json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}],
                                                     "max_tokens": 2, "priority": priority})
            assert r.status_code == 200, r.text


def test_bad_words_hold_against_a_bias_toward_them(server):
    """bad_words (vLLM's), tokenized in the API process: "a" banned in both its forms, though a
    +100 logit_bias would otherwise pick them every time."""
    from transformers import AutoTokenizer

    from pagedserve.engine.bad_words import tokenize_bad_words
    banned = {w[-1] for w in tokenize_bad_words(["a"], AutoTokenizer.from_pretrained(server.model_dir))}
    bias = {str(t): 100 for t in banned}
    with httpx.Client(base_url=server.base_url, timeout=120) as c:
        for extra in ({}, {"bad_words": ["a"]}):
            r = c.post("/v1/completions", json={"model": "tiny", "prompt": [5, 17], "max_tokens": 6, "temperature": 1.0,
                                                "logit_bias": bias, "logprobs": 0, **extra})
            assert r.status_code == 200, r.text
            tokens = {int(t.split(":")[1]) for t in r.json()["choices"][0]["logprobs"]["tokens"]}
            assert (tokens <= banned) if not extra else not (tokens & banned), (extra, tokens)


def test_usage_counts_cached_prompt_tokens(server):
    """--enable-prompt-tokens-details: usage.prompt_tokens_details.cached_tokens is the prompt's
    prefix-cache hit (its full blocks of 16 but the last token's), streamed or not, both endpoints."""
    prompt = list(range(300, 300 + 40))
    with httpx.Client(base_url=server.base_url, timeout=120) as c:
        def cmpl(**kw):
            r = c.post("/v1/completions", json={"model": "tiny", "prompt": prompt, "max_tokens": 2, **kw})
            assert r.status_code == 200, r.text
            return r
        assert cmpl().json()["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
        assert cmpl().json()["usage"]["prompt_tokens_details"] == {"cached_tokens": 32}
        events = [line[6:] for line in cmpl(stream=True, stream_options={"include_usage": True}).text.splitlines()
                  if line.startswith("data: {")]
        assert json.loads(events[-1])["usage"]["prompt_tokens_details"] == {"cached_tokens": 32}
        msgs = [{"role": "user", "content": "the same conversation twice " * 4}]
        first = c.post("/v1/chat/completions", json={"model": "tiny", "messages": msgs, "max_tokens": 1}).json()
        again = c.post("/v1/chat/completions", json={"model": "tiny", "messages": msgs, "max_tokens": 1}).json()
        n = again["usage"]["prompt_tokens"]
        # (this server's template starts every chat alike: the first may hit its opening blocks)
        assert first["usage"]["prompt_tokens_details"]["cached_tokens"] < \
            again["usage"]["prompt_tokens_details"]["cached_tokens"] == (n - 1) // 16 * 16
