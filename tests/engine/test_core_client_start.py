"""MPCoreClient's start-up: the front end's own start-up work (the tokenizer's load) runs while the
core process starts, not before it, and a failure there stops the core at once.

A puppet core (real sockets, no model) writes a file when it is running and sends Ready only once
the front end's work has written another: a client that ran that work before launching the core,
or after waiting for Ready, never gets there.
"""
from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import pytest

from pagedserve.config import EngineConfig
from pagedserve.engine.core_client import MPCoreClient

ROOT = str(Path(__file__).resolve().parents[2])
PUPPET = """
import os, sys, time, zmq
from pagedserve.engine.core_messages import Codec, Ready, Shutdown
a = sys.argv[1:]
open(os.environ["PUPPET_RUNNING"], "w").write(str(os.getpid()))
while not os.path.exists(os.environ["PUPPET_GO"]):
    time.sleep(0.01)
ctx = zmq.Context()
inp, out = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
inp.connect(a[a.index("--input") + 1])
out.connect(a[a.index("--output") + 1])
codec = Codec()
out.send(codec.encode(Ready(0, 64, 100, 8, 0, 16, 8, [2])))
while not any(isinstance(op, Shutdown) for op in codec.inputs.decode(inp.recv()).ops):
    pass
"""


@pytest.fixture
def files(tmp_path, monkeypatch):
    running, go = tmp_path / "running", tmp_path / "go"
    monkeypatch.setenv("PYTHONPATH", ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    monkeypatch.setenv("PUPPET_RUNNING", str(running))
    monkeypatch.setenv("PUPPET_GO", str(go))
    return running, go


def wait_for(path: Path) -> None:
    deadline = time.monotonic() + 60
    while not path.exists():
        if time.monotonic() > deadline:
            raise AssertionError(f"{path.name} never appeared")
        time.sleep(0.01)


def test_the_front_ends_start_up_work_runs_while_the_core_starts(files):
    running, go = files
    seen = []

    def work() -> None:
        wait_for(running)  # the core is already up: the two overlap
        seen.append(int(running.read_text()))
        go.write_text("")  # and Ready comes only after this work, so it ran before the wait

    client = MPCoreClient(EngineConfig(), ready_timeout_s=60, core_cmd=[sys.executable, "-c", PUPPET],
                          while_starting=work)
    try:
        assert seen == [client.pid] and client.ready.max_model_len == 64
    finally:
        client.shutdown()
    assert client.proc.returncode == 0  # it took the Shutdown: a normal end


def test_a_failure_of_the_front_ends_work_stops_the_core_and_is_raised(files):
    running, _ = files

    def work() -> None:
        wait_for(running)
        raise OSError("tokenizer.json is unreadable")

    with pytest.raises(OSError, match="tokenizer.json is unreadable"):
        MPCoreClient(EngineConfig(), ready_timeout_s=60, core_cmd=[sys.executable, "-c", PUPPET],
                     while_starting=work)
    pid = int(running.read_text())
    with pytest.raises(ProcessLookupError):  # stopped and reaped before the error came back
        os.kill(pid, 0)
