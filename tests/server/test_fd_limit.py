"""The open-file limit: servers and benchmark clients raise their soft limit to the hard one at
start-up (every connection is a descriptor; at the limit uvloop resets new connections, which
clients see as httpx ReadError: pagedserve/entrypoints/fd_limit.py), and a benchmark client that
could not hold its connections refuses before sending. Each case runs in a child process whose
soft limit was lowered first, so this process's own limit is left alone."""
from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from pagedserve.benchmark.server_process import free_port, stop_process, wait_until_ready
from pagedserve.entrypoints.fd_limit import UNLIMITED_TARGET

ROOT = Path(__file__).resolve().parents[2]
HARD = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
LOW = 256

pytestmark = pytest.mark.skipif(HARD != resource.RLIM_INFINITY and HARD <= LOW,
                                reason=f"the hard open-file limit ({HARD}) leaves nothing to raise")


def _limits(soft: int, hard: int | None = None):
    """preexec_fn: the child starts with this soft (and hard) limit."""
    return lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (soft, HARD if hard is None else hard))


def _python(code: str, soft: int, hard: int | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120,
                          env=dict(os.environ, PYTHONPATH=str(ROOT)), preexec_fn=_limits(soft, hard))


def test_raise_fd_limit_raises_the_soft_limit_to_the_hard_one():
    r = _python("import json, resource\n"
                "from pagedserve.entrypoints.fd_limit import raise_fd_limit\n"
                "before = resource.getrlimit(resource.RLIMIT_NOFILE)\n"
                "got = raise_fd_limit()\n"
                "print(json.dumps([before, got, resource.getrlimit(resource.RLIMIT_NOFILE)]))", LOW)
    assert r.returncode == 0, r.stderr
    before, got, after = json.loads(r.stdout)
    assert before[0] == LOW
    expected = UNLIMITED_TARGET if HARD == resource.RLIM_INFINITY else HARD
    assert got == after[0] == expected and after[1] == before[1]


def test_bench_client_refuses_more_connections_than_its_hard_limit_allows():
    """Hard limit 300 (a child may lower its own): 200 connections fit with the margin, 250 do
    not, and the refusal comes before anything is sent (no server listens on the port)."""
    code = ("from pagedserve.entrypoints.bench_serve import check_fd_limit\n"
            "import resource\n"
            "check_fd_limit(200)\n"
            "print(resource.getrlimit(resource.RLIMIT_NOFILE)[0])\n"
            "try:\n"
            "    check_fd_limit(250)\n"
            "except ValueError as e:\n"
            "    print('refused:', e)\n")
    r = _python(code, 100, 300)
    assert r.returncode == 0, r.stderr
    raised, refusal = r.stdout.splitlines()
    assert raised == "300"  # raised from 100 to the hard limit
    assert refusal.startswith("refused: max_concurrency: 250 connections at once") and "has 300" in refusal


def test_served_process_runs_with_its_soft_limit_raised(tiny_model_dir, tmp_path):
    """`pagedserve serve` started with a soft limit of 256 holds the hard limit once up (its
    /proc limits), and so does its engine core process, started after the raise."""
    port = free_port()
    cmd = [sys.executable, "-m", "pagedserve.entrypoints.cli", "serve", str(tiny_model_dir("llama")),
           "--port", str(port), "--device", "cpu", "--dtype", "float32", "--num-gpu-blocks-override", "64",
           "--max-model-len", "128", "--swap-space", "0.05"]
    log = tmp_path / "server.log"
    # The limit note is an internal figure: DEBUG (pagedserve/log_setup.py).
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false",
               PAGEDSERVE_LOGGING_LEVEL="DEBUG")
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=ROOT,
                                preexec_fn=_limits(LOW))
    try:
        wait_until_ready(proc, f"http://127.0.0.1:{port}/health", 180, log_path=log)
        expected = UNLIMITED_TARGET if HARD == resource.RLIM_INFINITY else HARD
        assert _soft_limit(proc.pid) == expected
        children = subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True, text=True).stdout.split()
        assert children and all(_soft_limit(int(c)) == expected for c in children)
        assert f"open-file limit {expected}" in log.read_text()
        r = httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=30)
        assert r.status_code == 200
    finally:
        stop_process(proc, timeout=20)


def _soft_limit(pid: int) -> int:
    """/proc/PID/limits' soft "Max open files" of a running process."""
    line = next(x for x in Path(f"/proc/{pid}/limits").read_text().splitlines() if x.startswith("Max open files"))
    value = line.split()[3]
    return resource.RLIM_INFINITY if value == "unlimited" else int(value)
