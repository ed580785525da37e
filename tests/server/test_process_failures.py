"""The two processes of `pagedserve serve` outlive neither each other nor their errors.

- The engine core is killed: the stream in flight ends with an error naming the cause, new
  requests and /health answer 503 with it, and the server exits non-zero on its own.
- The server is SIGKILLed (no chance to clean up): the core notices and exits within 5 s.
- Both get SIGTERM at once (a process-group stop): the server still exits.
- The core fails to start (a setting only the engine can check): `pagedserve serve` prints the
  engine's one-line error and exits 2, leaving no process behind.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from server_process import REPO, free_port, start_server, stop_server


def _core_pid(server) -> int:
    """The engine core is the server's only child process."""
    pid = server.proc.pid
    children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    assert len(children) == 1, f"expected one engine-core child, got {children}"
    return int(children[0])


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie (exited, not yet reaped by its parent) has finished too.
    return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"


def _start(tiny_model_dir, tmp_path):
    return start_server(tiny_model_dir("llama"), tmp_path / "server.log", "--max-model-len", "512",
                        "--num-gpu-blocks-override", "128", "--swap-space", "0.05")


def test_killed_core_fails_requests_with_503_and_the_server_exits(tiny_model_dir, tmp_path):
    server = _start(tiny_model_dir, tmp_path)
    try:
        core = _core_pid(server)
        body = {"model": server.model, "prompt": "keep going", "max_tokens": 400,
                "temperature": 1.0, "ignore_eos": True, "stream": True}
        with httpx.Client(base_url=server.base_url, timeout=60) as http:
            with http.stream("POST", "/v1/completions", json=body) as r:
                assert r.status_code == 200
                lines = r.iter_lines()
                first = next(line for line in lines if line.startswith("data:"))
                assert '"text"' in first  # generating now
                os.kill(core, signal.SIGKILL)
                rest = [line for line in lines if line.startswith("data:")]
            assert rest[-1] == "data: [DONE]"
            errors = [line for line in rest if '"error"' in line]
            assert len(errors) == 1 and "engine core is dead" in errors[0] and "SIGKILL" in errors[0], rest[-3:]

            new = http.post("/v1/completions", json={"model": server.model, "prompt": "hello",
                                                     "max_tokens": 2})
            assert new.status_code == 503, new.text
            assert "engine core is dead" in new.json()["error"]["message"]
            health = http.get("/health")
            assert health.status_code == 503
            assert "SIGKILL" in health.json()["error"]["message"]
        assert server.proc.wait(timeout=30) != 0
        assert "engine core is dead" in server.log()
    finally:
        if server.proc.poll() is None:
            stop_server(server)


def test_sigkilled_server_takes_the_core_down_within_5s(tiny_model_dir, tmp_path):
    server = _start(tiny_model_dir, tmp_path)
    core = _core_pid(server)
    assert _alive(core)
    server.proc.kill()
    server.proc.wait()
    deadline = time.monotonic() + 5.0
    while _alive(core) and time.monotonic() < deadline:
        time.sleep(0.1)
    alive = _alive(core)
    if alive:  # do not leave it behind, whatever the verdict
        os.kill(core, signal.SIGKILL)
    assert not alive, "the engine core outlived its server by more than 5 s"


def test_sigterm_to_both_processes_stops_the_server(tiny_model_dir, tmp_path):
    """What `kill -TERM -PGID`, systemd and `docker stop` do: the core exits on its SIGTERM while
    the server shuts down, and the server's goodbye to the gone core must not block its exit."""
    server = _start(tiny_model_dir, tmp_path)
    core = _core_pid(server)
    os.kill(core, signal.SIGTERM)
    server.proc.terminate()
    try:
        server.proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        stop_server(server)
        raise AssertionError(f"the server still ran 30 s after SIGTERM:\n{server.log()}") from None
    assert server.proc.returncode in (0, -signal.SIGTERM)
    assert not _alive(core)


def test_core_start_up_error_is_one_line_and_exit_2(tiny_model_dir, tmp_path):
    """An error only the engine core finds (here a layer kind the model cannot build, which serve's
    preflight, reading config.json's limits only, lets through) is one line, printed once."""
    import json
    import shutil
    model = tmp_path / "windowed"
    shutil.copytree(tiny_model_dir("llama"), model)
    cfg = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps(dict(cfg, sliding_window=128,
                                                       layer_types=["full_attention", "chunked_attention"])))
    cmd = [sys.executable, "-m", "pagedserve.entrypoints.cli", "serve", str(model),
           "--device", "cpu", "--max-model-len", "256", "--port", str(free_port())]
    env = dict(os.environ, PYTHONPATH=f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    # run() reads stdout/stderr to EOF; the core shares them, so it has exited too by then.
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 2, r.stderr[-2000:]
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("pagedserve serve: error: config.layer_types: ['chunked_attention'] not supported"), last
    assert (r.stdout + r.stderr).count("not supported (full_attention") == 1, r.stderr[-2000:]
