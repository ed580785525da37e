"""Every text field of both endpoints with text that is not text: lone UTF-16 surrogates (a
JavaScript string cut inside an emoji), NULs and invalid UTF-8 bytes. Never a 5xx; surrogates
and bad bytes are a 400 naming the field; the server keeps serving on the same connection."""
from __future__ import annotations

import json
import re

import pytest

CMPL = "/v1/completions"
CHAT = "/v1/chat/completions"
MARK = "\ue000MARK\ue000"  # a private-use placeholder, replaced by raw bytes in the body

COMPLETION = {"model": "tiny", "prompt": "hello", "max_tokens": 1}
CHAT_BODY = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}

# (endpoint, field path as the error's param begins, how to put a text into the body)
FIELDS = [
    (CMPL, "prompt", lambda b, t: b.update(prompt=f"a{t}b")),
    (CMPL, "prompt", lambda b, t: b.update(prompt=["fine", t])),
    (CMPL, "model", lambda b, t: b.update(model=t)),
    (CMPL, "stop", lambda b, t: b.update(stop=t)),
    (CMPL, "stop", lambda b, t: b.update(stop=["x", t])),
    (CMPL, "user", lambda b, t: b.update(user=t)),
    (CMPL, "suffix", lambda b, t: b.update(suffix=t)),
    (CMPL, "logit_bias", lambda b, t: b.update(logit_bias={t: 1.0})),
    (CHAT, "messages", lambda b, t: b["messages"][0].update(content=f"say {t}")),
    (CHAT, "messages", lambda b, t: b["messages"][0].update(content=[{"type": "text", "text": t}])),
    (CHAT, "messages", lambda b, t: b["messages"][0].update(name=t)),
    (CHAT, "messages", lambda b, t: b["messages"].insert(0, {"role": "system", "content": t})),
    (CHAT, "model", lambda b, t: b.update(model=t)),
    (CHAT, "stop", lambda b, t: b.update(stop=[t])),
    (CHAT, "user", lambda b, t: b.update(user=t)),
    (CHAT, "logit_bias", lambda b, t: b.update(logit_bias={t: 1.0})),
]

SURROGATES = ["\ud800", "\udfff", "x\udc00\ud83dy", "\ud83d"]   # lone, reversed pair, cut emoji
NULS = ["\x00", "a\x00b\x00"]
BAD_UTF8 = [b"\xff", b"\xc3\x28", b"\xed\xa0\x80", b"\xc0\xaf", b"\xe2\x82"]  # CESU, overlong, cut


def _body(endpoint: str, put, text: str) -> dict:
    body = json.loads(json.dumps(COMPLETION if endpoint == CMPL else CHAT_BODY))
    put(body, text)
    return body


def _unhandled(server) -> int:
    return len(re.findall("unhandled error|Traceback", server.log_path.read_text(errors="replace")))


def test_text_that_is_not_text_is_never_a_server_error(server, http):
    before = _unhandled(server)
    failures = []

    def send(endpoint: str, content: bytes, what: str, field: str, want_400: bool) -> None:
        r = http.post(endpoint, content=content, headers={"Content-Type": "application/json"})
        if r.status_code >= 500 or (want_400 and r.status_code != 400):
            failures.append(f"{what} in {endpoint} {field}: {r.status_code} {r.text[:200]}")
            return
        if r.status_code >= 400:
            err = r.json()["error"]  # OpenAI's error shape, as JSON, even here
            assert err["message"] and err["type"]
            if want_400 and err["param"] is not None and not err["param"].startswith(field):
                failures.append(f"{what} in {endpoint} {field}: param {err['param']!r}")

    for endpoint, field, put in FIELDS:
        for s in SURROGATES:
            # ensure_ascii sends the surrogate as a JSON \\u escape, as a JavaScript client would
            send(endpoint, json.dumps(_body(endpoint, put, s)).encode(), f"surrogate {s!r}", field,
                 want_400=True)
        for s in NULS:
            send(endpoint, json.dumps(_body(endpoint, put, s)).encode(), f"NUL {s!r}", field,
                 want_400=False)
        for raw in BAD_UTF8:
            body = json.dumps(_body(endpoint, put, MARK), ensure_ascii=False).encode()
            send(endpoint, body.replace(MARK.encode(), raw), f"bytes {raw!r}", field, want_400=True)
    assert not failures, "\n".join(failures)

    # A surrogate is reported with the field's path, and no traceback reached the log.
    r = http.post(CHAT, content=json.dumps(_body(CHAT, FIELDS[9][2], "\ud800")).encode(),
                  headers={"Content-Type": "application/json"})
    assert r.status_code == 400
    assert r.json()["error"]["param"].startswith("messages.0.content")
    assert "surrogate" in r.json()["error"]["message"]
    assert _unhandled(server) == before

    # The same keep-alive connection still serves, and a NUL is just a character of the prompt.
    r = http.post(CMPL, json={"model": "tiny", "prompt": "a\x00b", "max_tokens": 2})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2


@pytest.mark.parametrize("text", ["\U0001F600 emoji", "naïve café 你好"])
def test_valid_non_ascii_text_still_accepted(http, text):
    """The surrogate check refuses only lone halves: a pair JSON-escaped is one real character."""
    body = json.dumps({"model": "tiny", "prompt": text, "max_tokens": 1, "echo": True})
    r = http.post(CMPL, content=body.encode(), headers={"Content-Type": "application/json"})
    assert r.status_code == 200
    assert r.json()["choices"][0]["text"].startswith(text)
