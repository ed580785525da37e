"""Bad input -> 4xx with OpenAI's error JSON naming the field; the server keeps serving."""
from __future__ import annotations

import json

import pytest

from server_process import MAX_MODEL_LEN

CMPL = "/v1/completions"
CHAT = "/v1/chat/completions"
MSG = [{"role": "user", "content": "hi"}]


def c(**kw):
    return {"model": "tiny", "prompt": "hello", "max_tokens": 4, **kw}


def ch(**kw):
    return {"model": "tiny", "messages": MSG, "max_tokens": 4, **kw}


# (id, path, JSON body or raw bytes, status, param)
CASES = [
    ("invalid-json", CMPL, b'{"prompt": "hi", ', 400, None),
    ("json-not-object", CMPL, b'[1, 2, 3]', 400, None),
    ("not-utf8", CMPL, b'{"model": "tiny", "prompt": "\xff\xfe\xfa", "max_tokens": 2}', 400, None),
    ("unknown-model", CMPL, c(model="gpt-5"), 404, "model"),
    ("unknown-model-chat", CHAT, ch(model="nope"), 404, "model"),
    ("missing-prompt", CMPL, {"model": "tiny"}, 400, "prompt"),
    ("empty-prompt", CMPL, c(prompt=""), 400, "prompt"),
    ("empty-prompt-list", CMPL, c(prompt=[]), 400, "prompt"),
    ("empty-token-list", CMPL, c(prompt=[[]]), 400, "prompt"),
    ("empty-string-in-list", CMPL, c(prompt=["a", ""]), 400, "prompt"),
    ("negative-token-id", CMPL, c(prompt=[1, -5]), 400, "prompt"),
    ("token-id-outside-vocab", CMPL, c(prompt=[1, 10**6]), 400, "prompt"),
    ("prompt-wrong-type", CMPL, c(prompt={"a": 1}), 400, "prompt"),
    ("too-long-for-context", CMPL, c(max_tokens=MAX_MODEL_LEN), 400, "max_tokens"),
    ("prompt-fills-context", CMPL, c(prompt=[5] * MAX_MODEL_LEN), 400, "prompt"),
    ("chat-too-long", CHAT, ch(max_tokens=MAX_MODEL_LEN), 400, "max_tokens"),
    ("chat-mct-too-long", CHAT, ch(max_tokens=None, max_completion_tokens=10**6), 400,
     "max_completion_tokens"),
    ("max-tokens-negative", CMPL, c(max_tokens=-1), 400, "max_tokens"),
    ("max-tokens-zero", CMPL, c(max_tokens=0), 400, "max_tokens"),
    ("max-tokens-string", CMPL, c(max_tokens="many"), 400, "max_tokens"),
    ("max-tokens-huge", CMPL, c(max_tokens=10**30), 400, "max_tokens"),
    ("temperature-negative", CMPL, c(temperature=-0.5), 400, "temperature"),
    ("temperature-absurd", CMPL, c(temperature=1e12), 400, "temperature"),
    ("temperature-nan", CMPL, b'{"model": "tiny", "prompt": "hi", "temperature": NaN}', 400,
     "temperature"),
    ("top-p-zero", CMPL, c(top_p=0), 400, "top_p"),
    ("top-k-below-minus-one", CMPL, c(top_k=-2), 400, "top_k"),
    ("min-p-above-one", CMPL, c(min_p=1.5), 400, "min_p"),
    ("presence-penalty", CMPL, c(presence_penalty=5), 400, "presence_penalty"),
    ("frequency-penalty", CHAT, ch(frequency_penalty=-3), 400, "frequency_penalty"),
    ("repetition-penalty-zero", CMPL, c(repetition_penalty=0), 400, "repetition_penalty"),
    ("repetition-penalty-tiny", CMPL, c(repetition_penalty=1e-300), 400, "repetition_penalty"),
    ("seed-negative", CMPL, c(seed=-1), 400, "seed"),
    ("seed-huge", CMPL, c(seed=2**70), 400, "seed"),
    ("n-zero", CMPL, c(n=0), 400, "n"),
    ("n-too-large", CMPL, c(n=10**6), 400, "n"),
    ("n-times-prompts-too-large", CMPL, c(prompt=["a", "b", "c"], n=100, temperature=1), 400, "n"),
    ("n-greedy", CHAT, ch(n=3, temperature=0), 400, "n"),
    ("best-of-below-n", CMPL, c(n=3, best_of=2, temperature=1), 400, "best_of"),
    ("best-of-streamed", CMPL, c(n=1, best_of=3, stream=True), 400, "best_of"),
    ("logprobs-too-many", CMPL, c(logprobs=50), 400, "logprobs"),
    ("top-logprobs-too-many", CHAT, ch(logprobs=True, top_logprobs=50), 400, "top_logprobs"),
    ("top-logprobs-without-logprobs", CHAT, ch(top_logprobs=2), 400, "top_logprobs"),
    ("min-tokens-above-max", CMPL, c(min_tokens=10, max_tokens=4), 400, "min_tokens"),
    ("stop-empty-string", CMPL, c(stop=[""]), 400, "stop"),
    ("stop-token-outside-vocab", CMPL, c(stop_token_ids=[10**6]), 400, "stop_token_ids"),
    ("empty-messages", CHAT, ch(messages=[]), 400, "messages"),
    ("missing-messages", CHAT, {"model": "tiny"}, 400, "messages"),
    ("bad-role", CHAT, ch(messages=[{"role": "wizard", "content": "x"}]), 400, "messages.0.role"),
    ("bad-content-part", CHAT, ch(messages=[{"role": "user", "content": [{"type": "image_url"}]}]),
     400, "messages.0.content"),
    ("logit-bias-not-a-token", CMPL, c(logit_bias={"five": 10}), 400, "logit_bias"),
    ("logit-bias-outside-vocab", CMPL, c(logit_bias={"1000000": 10}), 400, "logit_bias"),
    ("logit-bias-too-large", CHAT, ch(logit_bias={"5": 150}), 400, "logit_bias"),
    ("cache-salt-empty", CMPL, c(cache_salt=""), 400, "cache_salt"),
    ("priority-under-fcfs", CHAT, ch(priority=1), 400, "priority"),
    ("allowed-token-ids-empty", CMPL, c(allowed_token_ids=[]), 400, "allowed_token_ids"),
    ("allowed-token-ids-outside-vocab", CHAT, ch(allowed_token_ids=[10**6]), 400, "allowed_token_ids"),
    ("suffix", CMPL, c(suffix="tail"), 400, "suffix"),
    ("stream-options-without-stream", CMPL, c(stream_options={"include_usage": True}), 400,
     "stream_options"),
    ("stream-options-without-stream-chat", CHAT, ch(stream=False, stream_options={"include_usage": False}),
     400, "stream_options"),
]


def _post(http, path, body):
    if isinstance(body, bytes):
        return http.post(path, content=body, headers={"Content-Type": "application/json"})
    return http.post(path, json=body)


def _assert_still_serving(http):
    r = http.post(CMPL, json=c(max_tokens=2, temperature=0))
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] >= 1


@pytest.mark.parametrize("name,path,body,status,param", CASES, ids=[x[0] for x in CASES])
def test_bad_input_is_a_clean_4xx(http, name, path, body, status, param):
    r = _post(http, path, body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["type"] == "invalid_request_error"
    assert err["message"]
    assert err["param"] == param, err
    if name.startswith("too-long") or name == "chat-too-long":
        assert str(MAX_MODEL_LEN) in err["message"]  # says the limit


def test_server_survives_every_bad_input(http):
    for _, path, body, _, _ in CASES:
        _post(http, path, body)
    _assert_still_serving(http)


def test_body_size_is_bounded(http):
    big = json.dumps(c(prompt="x" * 100_000)).encode()
    r = _post(http, CMPL, big)
    assert r.status_code == 413
    assert r.json()["error"]["code"] == "request_too_large"
    _assert_still_serving(http)


def test_unknown_route_and_method(http):
    r = http.get("/v1/nope")
    assert r.status_code == 404 and "error" in r.json()
    r = http.get(CMPL)
    assert r.status_code == 405 and "error" in r.json()


def test_extreme_but_valid_values_are_served(http):
    """Values at the edge of the valid range must run, not crash the engine."""
    r = http.post(CMPL, json=c(top_k=10**6, min_p=1.0, repetition_penalty=2.0, temperature=100,
                               presence_penalty=2, frequency_penalty=-2, seed=2**63 - 1,
                               max_tokens=MAX_MODEL_LEN - 8, n=2, logprobs=20, stop=["\n"] * 4,
                               stop_token_ids=[0, 1, 2]))
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"]) == 2
    _assert_still_serving(http)


def test_a_tiny_temperature_is_raised_to_vllms_floor(http):
    """vLLM raises a temperature in (0, 0.01) to 0.01. 1e-300 was 0 in float32 (1e-30 overflowed
    the logits divided by it): a NaN softmax, and token 0 drawn at every step."""
    def tokens(**kw):
        r = http.post(CMPL, json=c(max_tokens=6, seed=7, logprobs=0, **kw))
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["logprobs"]["tokens"]
    for extra in ({}, {"top_p": 0.9}):
        floor = tokens(temperature=0.01, **extra)
        assert tokens(temperature=1e-300, **extra) == floor
        assert tokens(temperature=1e-30, **extra) == floor


def test_allowed_token_ids_that_leave_nothing_to_draw_is_a_400(http):
    """Nothing left to draw (bad_words ban every allowed token, or min_tokens holds back all of
    them, each a stop token): every logit -inf, a NaN softmax, and token 0 drawn at each step
    (a 200 of "<s><s>...") before this was refused."""
    ids = http.post("/tokenize", json={"prompt": "Z", "add_special_tokens": False}).json()["tokens"]
    assert len(ids) == 1
    r = http.post(CMPL, json=c(allowed_token_ids=ids, bad_words=["Z"]))
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "allowed_token_ids" and "bad_words" in err["message"], err
    other = http.post("/tokenize", json={"prompt": "q", "add_special_tokens": False}).json()["tokens"]
    r = http.post(CMPL, json=c(allowed_token_ids=ids + other, bad_words=["Z"], max_tokens=3))
    assert r.status_code == 200 and set(r.json()["choices"][0]["text"]) <= {"q"}, r.text
    r = http.post(CMPL, json=c(allowed_token_ids=ids, stop_token_ids=ids, min_tokens=2))
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "allowed_token_ids" and "min_tokens (2)" in err["message"], err
    r = http.post(CMPL, json=c(allowed_token_ids=ids, stop_token_ids=ids))  # no min_tokens: it stops
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "stop", r.text


def test_tool_call_arguments_nested_past_jsons_recursion_are_text(http):
    """The history's arguments are passed to the template as an object where they parse as one:
    json.loads of "[[[[..." ran out of recursion, a 500. Now they are text, as any non-JSON is."""
    r = http.post(CHAT, json=ch(messages=[*MSG, {"role": "assistant", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "[" * 3000 + "]" * 3000}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "x"}]))
    assert r.status_code == 200, r.text


def test_values_nested_as_deep_as_the_parser_goes_are_no_500(http):
    """Nested objects as deep as the body's JSON parser accepts (about 960: deeper is its own
    400): the check of every string for lone surrogates walked them recursively and ran out of
    Python's recursion limit, a 500, at the depths just below the parser's."""
    for depth in range(900, 1001, 4):
        nested = "1"
        for _ in range(depth):
            nested = '{"a":' + nested + "}"
        for path, body in ((CHAT, ch(max_tokens=1)), (CMPL, c(max_tokens=1))):
            raw = json.dumps(body)[:-1] + ', "chat_template_kwargs": ' + nested + "}"
            r = _post(http, path, raw.encode())
            assert r.status_code < 500, (depth, path, r.text)
    _assert_still_serving(http)
