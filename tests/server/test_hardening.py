"""The edges of the single server as a hostile client tries them (issue #38), all on loopback,
with bounded counts: request heads bounded (431), parser errors as OpenAI JSON, slow and idle
connections cannot starve a normal client, JSON-only bodies (415), a Host check, strict types,
prompts too long rejected before tokenizing, an empty --api-key refused."""
from __future__ import annotations

import json
import socket

import httpx
import pytest

from pagedserve.entrypoints.cli import main as cli_main

CMPL = "/v1/completions"


def _addr(server) -> tuple[str, int]:
    host, port = server.base_url.removeprefix("http://").split(":")
    return host, int(port)


def _raw(server, data: bytes, timeout: float = 30.0) -> tuple[int, dict]:
    """Send raw bytes, read the answer to the end (the server closes): (status, JSON body)."""
    with socket.create_connection(_addr(server), timeout=timeout) as s:
        try:
            s.sendall(data)
        except (BrokenPipeError, ConnectionResetError):
            pass  # answered and closed before all was sent: the answer is still there to read
        got = b""
        while True:
            try:
                chunk = s.recv(65536)
            except ConnectionResetError:
                break
            if not chunk:
                break
            got += chunk
    head, _, body = got.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body)


def _still_serving(server) -> None:
    r = httpx.post(server.v1 + "/completions", headers=server.headers, timeout=60,
                   json={"model": server.model, "prompt": "hello", "max_tokens": 2})
    assert r.status_code == 200, r.text


def test_an_oversized_request_head_is_431_json(server):
    for big in (b"X-Big: " + b"a" * 200_000 + b"\r\n",
                b"".join(b"X-H%d: %s\r\n" % (i, b"b" * 1000) for i in range(100))):
        status, body = _raw(server, b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n" + big + b"\r\n")
        assert status == 431 and body["error"]["code"] == "request_header_fields_too_large", body
    status, body = _raw(server, b"GET /" + b"x" * 100_000 + b" HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
    assert status == 431, body
    _still_serving(server)


def test_http_parser_errors_are_openai_json(server):
    for data in (b"BREW /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n",
                 b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: abc\r\n\r\n",
                 b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nBad Header\r\n\r\n"):
        status, body = _raw(server, data)
        assert status == 400 and body["error"]["type"] == "invalid_request_error", (data, body)


def test_idle_and_half_sent_connections_do_not_starve_a_normal_client(server):
    """slowloris, bounded: 100 idle connections, 100 that sent half a request head, 20 that send
    a body a byte at a time; a normal client is served meanwhile."""
    addr = _addr(server)
    held = []
    try:
        for i in range(220):
            s = socket.create_connection(addr, timeout=10)
            if 100 <= i < 200:
                s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: ")
            elif i >= 200:
                s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer "
                          + server.api_key.encode() + b"\r\nContent-Type: application/json\r\n"
                          b"Content-Length: 1000\r\n\r\n{")
            held.append(s)
        for _ in range(3):
            _still_serving(server)
            for s in held[200:]:
                s.sendall(b" ")
        assert httpx.get(server.base_url + "/health", timeout=10).status_code == 200
    finally:
        for s in held:
            s.close()


def test_request_bodies_must_be_json(server):
    body = json.dumps({"model": server.model, "prompt": "hi", "max_tokens": 1})
    for ctype in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x", None):
        headers = dict(server.headers, **({"Content-Type": ctype} if ctype else {}))
        r = httpx.post(server.v1 + "/completions", content=body, headers=headers, timeout=30)
        assert r.status_code == 415 and r.json()["error"]["code"] == "unsupported_media_type", (ctype, r.text)
    r = httpx.post(server.v1 + "/completions", content=body, timeout=30,
                   headers=dict(server.headers, **{"Content-Type": "application/json; charset=utf-8"}))
    assert r.status_code == 200, r.text


def test_only_allowed_hosts_are_answered(server):
    _, port = _addr(server)
    for host in ("evil.example", f"evil.example:{port}", "127.0.0.1.nip.io", "localhost.evil.example"):
        r = httpx.get(server.base_url + "/kv_cache/state", headers=dict(server.headers, Host=host), timeout=30)
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_host", (host, r.text)
    for host in ("localhost", f"localhost:{port}", f"127.0.0.1:{port}"):
        r = httpx.get(server.v1 + "/models", headers=dict(server.headers, Host=host), timeout=30)
        assert r.status_code == 200, (host, r.text)


@pytest.mark.parametrize("field,value", [
    ("stream", "yes"), ("stream", 1), ("max_tokens", "16"), ("max_tokens", 16.0), ("n", True),
    ("prompt", [True, False]), ("prompt", ["1", 2]), ("prompt", [[1, "2"]]), ("stop_token_ids", ["1"]),
    ("echo", "true"), ("logprobs", "1"), ("seed", "7"), ("ignore_eos", 0), ("temperature", "0.5"),
    ("stream_options", {"include_usage": "yes"}),
])
def test_types_are_strict_where_openai_is(http, field, value):
    body = {"model": "tiny", "prompt": "hello", "max_tokens": 2, field: value}
    if field == "stream_options":
        body["stream"] = True
    r = http.post(CMPL, json=body)
    assert r.status_code == 400, (field, value, r.text)
    assert r.json()["error"]["param"].split(".")[0] == field, r.text


def test_chat_types_are_strict(http):
    msgs = [{"role": "user", "content": "hi"}]
    for field, value in (("logprobs", "yes"), ("max_completion_tokens", "3"), ("top_logprobs", "2")):
        r = http.post("/v1/chat/completions", json={"model": "tiny", "messages": msgs, "max_tokens": 2,
                                                    "logprobs": True, field: value})
        assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text
    r = http.post("/v1/chat/completions", json={"model": "tiny", "messages": msgs, "max_tokens": 2,
                                                "temperature": 1, "top_p": 1})  # ints for floats: fine
    assert r.status_code == 200, r.text


def test_a_prompt_too_long_is_refused_before_tokenizing(http, server):
    """60,000 characters cannot be <= 512 tokens of this vocabulary: refused on its length, and
    the tokenizer thread is not kept busy (a short request right after is served)."""
    for body in ({"prompt": "a b " * 15_000}, {"prompt": ["hi", "z" * 60_000]}):
        r = http.post(CMPL, json={"model": "tiny", "max_tokens": 2, **body})
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["code"] == "context_length_exceeded" and "characters" in err["message"], err
    r = http.post("/v1/chat/completions", json={"model": "tiny", "max_tokens": 2,
                                                "messages": [{"role": "user", "content": "q" * 60_000}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages", r.text
    _still_serving(server)


@pytest.mark.parametrize("argv,env", [(["--api-key", ""], {}), (["--api-key", "  "], {}),
                                      ([], {"PAGEDSERVE_API_KEY": ""})])
def test_an_empty_api_key_is_refused(argv, env, monkeypatch, capsys):
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    assert cli_main(["serve", *argv, "--port", "1"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "empty" in err, err
