"""`pagedserve bench serve` replays a workload against a real server and reports its numbers."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import httpx
import pytest

from server_process import MAX_MODEL_LEN, REPO, free_port, start_server, stop_server
from pagedserve.workloads import make_workload


@pytest.fixture(scope="module")
def wide_server(tiny_model_dir, tmp_path_factory):
    """Workload prompts draw ids from [0, 10000): a tiny model with a vocab that wide."""
    model = tiny_model_dir("llama", vocab_size=10240, max_position_embeddings=2048)
    s = start_server(model, tmp_path_factory.mktemp("bench") / "server.log",
                     "--max-model-len", "2048", "--num-gpu-blocks-override", "512",
                     "--swap-space", "0.05", "--disable-uvicorn-access-log")
    yield s
    stop_server(s)


def test_bench_serve_against_server(wide_server, tmp_path):
    out = tmp_path / "bench.json"
    n, rate = 8, 50.0
    cmd = [sys.executable, "-m", "pagedserve.entrypoints.cli", "bench", "serve",
           "--base-url", wide_server.v1, "--workload", "alpaca-like", "--num-requests", str(n),
           "--request-rate", str(rate), "--output", str(out)]
    env = dict(os.environ, PYTHONPATH=str(REPO))
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr + wide_server.log()
    assert "output throughput" in p.stdout
    doc = json.loads(out.read_text())
    assert doc["commit"] and doc["command"].startswith("pagedserve bench serve --base-url")
    res = doc["results"]
    work = make_workload("alpaca-like", n, rate)
    assert res["completed"] == n and res["failed"] == 0
    # ignore_eos and max_tokens = output_len: the server produced exactly the workload's tokens
    assert [r["output_len"] for r in res["requests"]] == [w.output_len for w in work]
    assert [r["prompt_len"] for r in res["requests"]] == [len(w.prompt_token_ids) for w in work]
    assert res["total_output_tokens"] == sum(w.output_len for w in work)
    for key in ("ttft_ms", "tpot_ms", "e2e_latency_ms"):
        assert set(res[key]) == {"mean", "p50", "p90", "p99"}
        assert 0 < res[key]["p50"] <= res[key]["p90"] <= res[key]["p99"]
    assert res["request_throughput"] > 0 and res["output_throughput"] > 0
    assert doc["config"]["request_rate"] == rate
    assert '"POST /v1/completions' not in wide_server.log()  # --disable-uvicorn-access-log


def _bench(argv: list[str], capsys) -> tuple[int, str, str]:
    from pagedserve.entrypoints.cli import main
    rc = main(["bench", "serve", *argv])
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_bench_serve_fits_a_small_model(server, tmp_path, capsys):
    """The shared server's model has 384 token ids and a 512-token context, far below what the
    workloads assume (ids < 10000, 2048 tokens): /v1/models tells bench serve both."""
    cfg = json.loads((server.model_dir / "config.json").read_text())
    card = httpx.get(server.v1 + "/models", headers=server.headers, timeout=10).json()["data"][0]
    assert card["vocab_size"] == cfg["vocab_size"] and card["max_model_len"] == MAX_MODEL_LEN
    out, n = tmp_path / "bench.json", 6
    rc, stdout, stderr = _bench(["--base-url", server.v1, "--api-key", server.api_key,
                                 "--workload", "sharegpt-like", "--num-requests", str(n),
                                 "--max-concurrency", "3", "--output", str(out)], capsys)
    assert rc == 0, stderr
    doc = json.loads(out.read_text())
    res = doc["results"]
    assert res["completed"] == n and res["failed"] == 0
    assert doc["config"]["vocab_size"] == cfg["vocab_size"]
    assert doc["config"]["max_model_len"] == MAX_MODEL_LEN
    work = make_workload("sharegpt-like", n, vocab_size=cfg["vocab_size"], max_total_len=MAX_MODEL_LEN)
    assert all(max(w.prompt_token_ids) < cfg["vocab_size"] for w in work)
    assert [r["prompt_len"] for r in res["requests"]] == [len(w.prompt_token_ids) for w in work]
    assert [r["output_len"] for r in res["requests"]] == [w.output_len for w in work]
    assert f"{n}/{n}" in stderr  # the progress bar reached the end
    assert '"POST /v1/completions HTTP/1.1" 200' in server.log()  # access log on by default


def test_bench_serve_flags_override_the_model_card(server, tmp_path, capsys):
    out = tmp_path / "bench.json"
    rc, _, stderr = _bench(["--base-url", server.v1, "--api-key", server.api_key, "--workload",
                            "alpaca-like", "--num-requests", "2", "--tokenizer", str(server.model_dir),
                            "--max-model-len", "64", "--disable-tqdm", "--output", str(out)], capsys)
    assert rc == 0, stderr
    from transformers import AutoTokenizer
    cfg = json.loads(out.read_text())["config"]
    assert cfg["vocab_size"] == len(AutoTokenizer.from_pretrained(server.model_dir))
    assert cfg["max_model_len"] == 64
    assert "requests:" not in stderr
    rc, _, _ = _bench(["--base-url", server.v1, "--api-key", server.api_key, "--num-requests", "1",
                       "--vocab-size", "7", "--max-model-len", "64", "--disable-tqdm", "--output",
                       str(out)], capsys)
    assert rc == 0 and json.loads(out.read_text())["config"]["vocab_size"] == 7


def test_bench_serve_errors_are_one_line(server, capsys):
    unreachable = f"http://127.0.0.1:{free_port()}/v1"
    for argv, words in [
        (["--base-url", unreachable], ["cannot reach", unreachable]),
        (["--base-url", server.v1, "--api-key", "wrong"], ["401", "--api-key"]),
        (["--base-url", server.v1, "--api-key", server.api_key, "--workload", "fixed256",
          "--max-model-len", "100"], ["max_total_len", "512"]),
        (["--base-url", server.v1, "--request-rate", "0"], ["--request-rate", "> 0"]),
    ]:
        try:
            rc, stdout, stderr = _bench(argv, capsys)
        except SystemExit as e:  # argparse's own errors exit; ours return
            rc, stderr = e.code, capsys.readouterr().err
        assert rc == 2, argv
        assert len(stderr.strip().splitlines()) == 1 and "Traceback" not in stderr, stderr
        for w in words:
            assert w in stderr, (w, stderr)


def test_bench_serve_several_client_processes(server, tmp_path, capsys):
    """--num-client-processes K: the requests split over K processes, merged back in order."""
    cfg = json.loads((server.model_dir / "config.json").read_text())
    out, n = tmp_path / "bench.json", 7
    rc, stdout, stderr = _bench(["--base-url", server.v1, "--api-key", server.api_key,
                                 "--workload", "sharegpt-like", "--num-requests", str(n),
                                 "--max-concurrency", "4", "--num-client-processes", "3",
                                 "--output", str(out)], capsys)
    assert rc == 0, stderr
    doc = json.loads(out.read_text())
    res = doc["results"]
    assert res["completed"] == n and res["failed"] == 0
    assert doc["config"]["num_client_processes"] == 3 and res["num_client_processes"] == 3
    assert res["client_cpu_s"] > 0
    work = make_workload("sharegpt-like", n, vocab_size=cfg["vocab_size"], max_total_len=MAX_MODEL_LEN)
    assert [r["prompt_len"] for r in res["requests"]] == [len(w.prompt_token_ids) for w in work]
    assert [r["output_len"] for r in res["requests"]] == [w.output_len for w in work]
    assert res["total_output_tokens"] == sum(w.output_len for w in work)
    assert 0 < res["ttft_ms"]["p50"] <= res["ttft_ms"]["p99"]
    assert res["duration_s"] >= max(r["latency"] for r in res["requests"])
    # Send times are from the union's start: none before it, the last first token before its end.
    assert min(r["sent_at"] for r in res["requests"]) >= 0
    assert max(r["sent_at"] + r["ttft"] for r in res["requests"]) == res["backlog"]["window_s"]
    assert 0 < res["backlog"]["window_s"] <= res["duration_s"]


def test_backlog_throughput_counts_tokens_until_the_last_first_token():
    from pagedserve.entrypoints.bench_stats import RequestResult, backlog_throughput
    # A sent at 0, first token at 1 s, then one every second: tokens at 1, 2, 3, 4.
    a = RequestResult(prompt_len=1, expected_output_len=4, output_len=4, ttft=1.0, itl=[1.0, 1.0, 1.0],
                      sent_at=0.0)
    # B sent at 0.5, first token at 3.0 (the last first token): its 1 token there counts, the next does not.
    b = RequestResult(prompt_len=1, expected_output_len=2, output_len=2, ttft=2.5, itl=[0.5], sent_at=0.5)
    # C: two tokens per chunk (a relay's burst), chunks at 0.5 and 2.5: 4 tokens by 3.0.
    c = RequestResult(prompt_len=1, expected_output_len=4, output_len=4, ttft=0.5, itl=[2.0], sent_at=0.0)
    failed = RequestResult(prompt_len=1, expected_output_len=4, ttft=9.0, sent_at=0.0, error="HTTP 500")
    got = backlog_throughput([a, b, c, failed])
    assert got == {"window_s": 3.0, "output_throughput": (3 + 1 + 4) / 3.0}
    assert backlog_throughput([RequestResult(prompt_len=1, expected_output_len=1, error="x")]) is None


def test_tokens_between_counts_the_tokens_that_arrived_in_the_window():
    from dataclasses import asdict

    from pagedserve.entrypoints.bench_stats import RequestResult, tokens_between
    # Tokens at 1, 2, 3, 4 s.
    a = RequestResult(prompt_len=1, expected_output_len=4, output_len=4, ttft=1.0, itl=[1.0, 1.0, 1.0], sent_at=0.0)
    # Two chunks of two tokens, at 0.5 and 2.5 s.
    c = RequestResult(prompt_len=1, expected_output_len=4, output_len=4, ttft=0.5, itl=[2.0], sent_at=0.0)
    failed = RequestResult(prompt_len=1, expected_output_len=4, ttft=2.0, sent_at=0.0, error="HTTP 500")
    records = [asdict(r) for r in (a, c, failed)]
    assert tokens_between(records, 1.5, 3.0) == 2 + 2     # a at 2 and 3; c's chunk at 2.5
    assert tokens_between(records, 0.0, 1.0) == 1 + 2     # a's first token; c's first chunk
    assert tokens_between(records, 4.5, 9.0) == 0
    # Windows that tile the run count every token once.
    assert sum(tokens_between(records, t, t + 0.5 - 1e-9) for t in [0.5 * i for i in range(10)]) == 8


def test_a_reset_connection_names_its_cause_and_errors_are_counted_by_kind():
    """httpx's ReadError on a reset connection has an empty message (anyio's
    BrokenResourceError): the recorded error names the OS error beneath it."""
    import anyio

    from pagedserve.entrypoints.bench_stats import describe_error, error_counts

    def reset() -> BaseException:
        try:
            try:
                try:
                    raise ConnectionResetError(104, "Connection reset by peer")
                except OSError as e:
                    raise anyio.BrokenResourceError from e
            except anyio.BrokenResourceError as e:
                raise httpx.ReadError("") from e
        except httpx.ReadError as e:
            return e
    assert describe_error(reset()) == "ReadError:  (ConnectionResetError: [Errno 104] Connection reset by peer)"
    assert describe_error(httpx.ReadTimeout("timed out")) == "ReadTimeout: timed out"
    assert error_counts(["HTTP 500: x", describe_error(reset()), "ReadError: ", "HTTP 500: y", "HTTP 503: z"]) == \
        {"ReadError": 2, "HTTP 500": 2, "HTTP 503": 1}


def test_stream_is_read_to_its_end_so_the_connection_is_reused():
    """httpx returns a connection to its pool only once the response body has been read to the
    end; send_request must not stop at [DONE] (it did: one new connection per request)."""
    import asyncio

    from pagedserve.entrypoints.bench_client import send_request
    from pagedserve.workloads import WorkloadRequest

    ended = []

    class Body(httpx.AsyncByteStream):
        async def __aiter__(self):
            yield b'data: {"choices": [{"text": "a"}]}\n\n'
            yield b'data: {"choices": [], "usage": {"completion_tokens": 1}}\n\n'
            yield b"data: [DONE]\n\n"
            yield b"\n"  # what follows [DONE] (here a blank line, on the wire the last chunk)
            ended.append(True)

    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, stream=Body(), headers={"content-type": "text/event-stream"})

    async def run():
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
            req = WorkloadRequest(prompt_token_ids=[1, 2], output_len=1, arrival_time=0.0)
            return await send_request(client, "http://x/v1", "m", req, {}, 0.0)
    res = asyncio.run(run())
    assert res.error is None and res.output_len == 1 and res.ttft is not None
    assert ended == [True]


def test_client_drops_idle_connections_before_the_server_does():
    """A pooled connection the server is closing (idle for its keep-alive) must never be reused:
    the benchmark client and the DP relay expire theirs first (at equal times, a 60,000-request
    run saw 52 requests reset)."""
    from pagedserve.entrypoints.bench_client import client_limits
    from pagedserve.entrypoints.http_stack import SERVER_KEEP_ALIVE_S
    from pagedserve.serving.relay_clients import HttpxRelay

    limits = client_limits(16)
    assert limits.max_connections == limits.max_keepalive_connections == 16
    assert 0 < limits.keepalive_expiry < SERVER_KEEP_ALIVE_S
    relay = HttpxRelay()
    assert 0 < relay.client._transport._pool._keepalive_expiry < SERVER_KEEP_ALIVE_S


def test_retry_only_requests_that_got_no_response():
    """retries=1: a request whose connection failed before any status line is sent again and
    counted; one that failed mid-stream, after its 200, is not (it may have run)."""
    import asyncio

    from pagedserve.entrypoints.bench_client import send_request
    from pagedserve.entrypoints.bench_stats import summarize
    from pagedserve.workloads import WorkloadRequest

    calls = []

    class Broken(httpx.AsyncByteStream):
        async def __aiter__(self):
            yield b'data: {"choices": [{"text": "a"}]}\n\n'
            raise httpx.ReadError("connection lost mid-stream")

    def handler(request: httpx.Request) -> httpx.Response:
        calls.append(request.url.path)
        kind = request.headers["x-case"]
        if kind == "unanswered" and calls.count(request.url.path) % 2 == 1:
            raise httpx.ReadError("")  # what the H200 toggle run saw: no status line, no OS error
        if kind == "midstream":
            return httpx.Response(200, stream=Broken(), headers={"content-type": "text/event-stream"})
        body = (b'data: {"choices": [{"text": "a"}]}\n\n'
                b'data: {"choices": [], "usage": {"completion_tokens": 1}}\n\ndata: [DONE]\n\n')
        return httpx.Response(200, content=body, headers={"content-type": "text/event-stream"})

    async def send(case: str, retries: int):
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
            req = WorkloadRequest(prompt_token_ids=[1, 2], output_len=1, arrival_time=0.0)
            return await send_request(client, "http://x/v1", "m", req, {"x-case": case}, 0.0, retries=retries)

    failed = asyncio.run(send("unanswered", 0))
    assert failed.error.startswith("ReadError") and failed.retries == 0 and len(calls) == 1
    calls.clear()
    retried = asyncio.run(send("unanswered", 1))
    assert retried.error is None and retried.output_len == 1 and retried.retries == 1 and len(calls) == 2
    calls.clear()
    midstream = asyncio.run(send("midstream", 1))
    assert midstream.error.startswith("ReadError") and midstream.retries == 0 and len(calls) == 1
    summary = summarize([failed, retried, midstream], 1.0)
    assert summary["retried"] == 1 and summary["failed"] == 2


def test_prompt_salt_changes_only_each_prompts_first_token():
    """Runs with different salts share no prefix block (the first token differs), with the same
    lengths and outputs, so their TPOTs compare like for like; salt 0 leaves the draw as it is."""
    from pagedserve.entrypoints.bench_serve import salt_prompts
    draw = 1000
    base = make_workload("sharegpt-like", 20, 10.0, seed=3, vocab_size=draw, max_total_len=512)
    for salt in (0, draw):
        same = make_workload("sharegpt-like", 20, 10.0, seed=3, vocab_size=draw, max_total_len=512)
        salt_prompts(same, salt, draw)
        assert [r.prompt_token_ids for r in same] == [r.prompt_token_ids for r in base]
    salted = make_workload("sharegpt-like", 20, 10.0, seed=3, vocab_size=draw, max_total_len=512)
    salt_prompts(salted, 7, draw)
    for a, b in zip(base, salted):
        assert a.output_len == b.output_len and len(a.prompt_token_ids) == len(b.prompt_token_ids)
        assert a.prompt_token_ids[1:] == b.prompt_token_ids[1:]
        assert b.prompt_token_ids[0] == (a.prompt_token_ids[0] + 7) % draw != a.prompt_token_ids[0]
