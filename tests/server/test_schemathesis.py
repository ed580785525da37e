"""Property-based fuzzing of the server against its own OpenAPI schema: never a 5xx."""
from __future__ import annotations

import hypothesis
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode


@pytest.fixture(scope="module")
def schema(server):
    return schemathesis.openapi.from_url(server.base_url + "/openapi.json")


def _operations(schema):
    ops = [r.ok() for r in schema.get_all_operations()]
    assert {(op.method.upper(), op.path) for op in ops} >= {
        ("POST", "/v1/completions"), ("POST", "/v1/chat/completions"), ("GET", "/v1/models")}
    return ops


def bound_cost(body) -> None:
    """Keep valid cases cheap on a CPU: at most 16 new tokens per sequence (n stays fuzzed).

    Without this, one valid case (say n=100, no max_tokens: fill the context) costs minutes.
    """
    if not isinstance(body, dict):
        return
    for key in ("max_tokens", "max_completion_tokens"):
        v = body.get(key)
        if isinstance(v, int) and not isinstance(v, bool) and v > 16:
            body[key] = 16
    if "messages" in body and body.get("max_tokens") is None and body.get("max_completion_tokens") is None:
        body["max_tokens"] = 16


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE])
def test_no_server_errors(server, schema, mode):
    failures = []
    for op in _operations(schema):
        post = op.method.upper() == "POST"
        if mode == GenerationMode.NEGATIVE and not post:
            continue  # nothing to get wrong in a GET without parameters
        examples = 25 if post else 5

        @settings(max_examples=examples, deadline=None, database=None, derandomize=True,
                  suppress_health_check=list(HealthCheck), phases=[hypothesis.Phase.generate])
        @given(case=op.as_strategy(mode))
        def run(case):
            bound_cost(case.body)
            r = case.call(base_url=server.base_url, headers=server.headers, timeout=120)
            if r.status_code >= 500:
                failures.append((op.method, op.path, case.body, r.status_code, r.text[:300]))

        run()
    assert not failures, failures[:5]
    assert server.proc.poll() is None
    # still healthy and serving after the fuzzing
    import httpx
    r = httpx.post(server.v1 + "/completions", headers=server.headers,
                   json={"model": server.model, "prompt": "ok", "max_tokens": 2})
    assert r.status_code == 200, r.text
