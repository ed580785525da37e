"""http_stack() names what uvicorn's "auto" choices will actually load, in this environment and
in one where httptools and uvloop cannot be imported."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

PROBE = """
import json, sys
if sys.argv[1] == "hidden":  # None in sys.modules: `import` raises ImportError, find_spec says None
    sys.modules["httptools"] = sys.modules["uvloop"] = None
from uvicorn.protocols.http.auto import AutoHTTPProtocol
from uvicorn.loops.auto import auto_loop_factory
from pagedserve.entrypoints.http_stack import http_stack
loop = auto_loop_factory()()
print(json.dumps({"ours": http_stack(), "uvicorn_http": AutoHTTPProtocol.__name__,
                  "uvicorn_loop": type(loop).__module__}))
"""


def _probe(mode: str) -> dict:
    r = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True, cwd=ROOT,
                       env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"}, timeout=60)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def _expected(probe: dict) -> dict:
    return {"http": "httptools" if probe["uvicorn_http"] == "HttpToolsProtocol" else "h11",
            "loop": "uvloop" if probe["uvicorn_loop"].startswith("uvloop") else "asyncio"}


def test_http_stack_matches_uvicorns_choice_here_and_without_the_c_parts():
    here, hidden = _probe("here"), _probe("hidden")
    assert here["ours"] == _expected(here)
    assert hidden["ours"] == _expected(hidden) == {"http": "h11", "loop": "asyncio"}


def test_benchmark_results_record_the_http_stack():
    from pagedserve.benchmark.results import _versions
    from pagedserve.entrypoints.http_stack import http_stack
    v = _versions()
    assert {"uvicorn_http": v["uvicorn_http"], "uvicorn_loop": v["uvicorn_loop"]} == {
        f"uvicorn_{k}": x for k, x in http_stack().items()}
