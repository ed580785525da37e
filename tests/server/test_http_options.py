"""vLLM's TLS, proxy and CORS flags of `serve` (entrypoints/http_options.py) on a real server:
https with a self-signed certificate, --root-path (the API key still guards /v1 under the prefix
uvicorn puts in front of every path) and --allowed-origins (CORS answers that origin only)."""
from __future__ import annotations

import argparse
import shutil
import ssl
import subprocess

import httpx
import pytest

from pagedserve.entrypoints.http_options import add_http_args, check_http_args
from server_process import start_server, stop_server

ORIGIN = "https://app.example"


def _parse(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser(exit_on_error=False)
    add_http_args(p)
    return p.parse_args(list(argv))


@pytest.fixture(scope="module")
def tls(tmp_path_factory):
    if shutil.which("openssl") is None:
        pytest.skip("needs the openssl command to make a certificate")
    d = tmp_path_factory.mktemp("tls")
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(d / "key.pem"),
                    "-out", str(d / "cert.pem"), "-days", "2", "-subj", "/CN=127.0.0.1",
                    "-addext", "subjectAltName=IP:127.0.0.1"], check=True, capture_output=True)
    return d


@pytest.fixture(scope="module")
def server(tiny_model_dir, tls, tmp_path_factory):
    ctx = ssl.create_default_context(cafile=str(tls / "cert.pem"))
    s = start_server(tiny_model_dir("llama"), tmp_path_factory.mktemp("https") / "server.log",
                     "--max-model-len", "128", "--num-gpu-blocks-override", "32", "--swap-space", "0.05",
                     "--ssl-keyfile", str(tls / "key.pem"), "--ssl-certfile", str(tls / "cert.pem"),
                     "--root-path", "/llm", "--allowed-origins", f'["{ORIGIN}"]', api_key="k", tls=ctx)
    yield s, ctx
    stop_server(s)


def test_https_serves_and_the_key_still_guards_v1_under_the_root_path(server):
    s, ctx = server
    with httpx.Client(base_url=s.base_url, verify=ctx, timeout=60) as c:
        r = c.post("/v1/completions", json={"model": "tiny", "prompt": [5, 6], "max_tokens": 2},
                   headers={"Authorization": "Bearer k"})
        assert r.status_code == 200, r.text
        assert c.get("/v1/models").status_code == 401  # uvicorn sees /llm/v1/models: still /v1
        assert c.get("/health").status_code == 200
    with pytest.raises(httpx.HTTPError):  # plain http to a TLS port
        httpx.get(s.base_url.replace("https", "http") + "/health", timeout=10)


def test_cors_answers_the_allowed_origin_only(server):
    s, ctx = server
    pre = {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "authorization"}
    with httpx.Client(base_url=s.base_url, verify=ctx, timeout=60) as c:
        ok = c.options("/v1/completions", headers={"Origin": ORIGIN, **pre})
        assert ok.status_code == 200 and ok.headers["access-control-allow-origin"] == ORIGIN
        other = c.options("/v1/completions", headers={"Origin": "https://evil.example", **pre})
        assert other.status_code == 400 and "access-control-allow-origin" not in other.headers
        r = c.get("/v1/models", headers={"Origin": ORIGIN, "Authorization": "Bearer k"})
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == ORIGIN


def test_no_cors_headers_unless_origins_are_given(tiny_model_dir, tmp_path):
    """Unlike vLLM's default of every origin: a page elsewhere cannot read this server's answers."""
    args = _parse()
    assert args.allowed_origins == [] and args.allowed_methods == ["*"]
    from fastapi import FastAPI
    from starlette.testclient import TestClient

    from pagedserve.entrypoints.http_options import add_cors
    app = FastAPI()
    app.get("/x")(lambda: {"ok": True})
    add_cors(app, args)
    r = TestClient(app).get("/x", headers={"Origin": ORIGIN})
    assert r.status_code == 200 and "access-control-allow-origin" not in r.headers


@pytest.mark.parametrize("argv, match", [
    (["--ssl-keyfile", "k.pem"], "--ssl-keyfile and --ssl-certfile go together"),
    (["--ssl-keyfile", "/no/k.pem", "--ssl-certfile", "/no/c.pem"], "--ssl-keyfile: no such file"),
    (["--ssl-cert-reqs", "2"], "--ssl-cert-reqs needs --ssl-ca-certs"),
    (["--root-path", "llm/"], "--root-path must start with /"),
])
def test_bad_combinations_are_one_line(argv, match):
    with pytest.raises(ValueError, match=match):
        check_http_args(_parse(*argv))


def test_origins_must_be_a_json_list():
    with pytest.raises(argparse.ArgumentError, match="JSON list of strings"):
        _parse("--allowed-origins", "*")


def test_relay_workers_get_the_same_flags_back():
    """--api-server-count > 1: every relay worker serves the port as the front end does."""
    from pagedserve.entrypoints.http_options import http_argv
    from pagedserve.serving.relay_worker import parse_worker_args
    argv = ["--ssl-keyfile", "k.pem", "--ssl-certfile", "c.pem", "--root-path", "/llm",
            "--allowed-origins", '["https://a.example", "https://b.example"]', "--allow-credentials",
            "--allowed-methods", '["POST"]']
    front = _parse(*argv)
    worker = parse_worker_args(["--host", "h", "--port", "1", "--route-address", "ipc://x", "--name", "1",
                                "--block-size", "16", "--max-request-bytes", "10", *http_argv(front)])
    for k in ("ssl_keyfile", "ssl_certfile", "ssl_ca_certs", "ssl_cert_reqs", "root_path", "allowed_origins",
              "allow_credentials", "allowed_methods", "allowed_headers"):
        assert getattr(worker, k) == getattr(front, k), k
    assert http_argv(_parse()) == []
