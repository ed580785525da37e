"""MPCoreClient's start-up: the front end's own start-up work (the tokenizer's load) runs while the
core process starts, not before it, and a failure there stops the core at once (and `pagedserve
serve` prints it as one line); a core stopped so, mid start-up, exits without reporting a failure.

A puppet core (real sockets, no model) writes a file when it is running and sends Ready only once
the front end's work has written another: a client that ran that work before launching the core,
or after waiting for Ready, never gets there.
"""
from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pagedserve.config import EngineConfig
from pagedserve.engine.core_client import MPCoreClient

from engine.helpers import puppet_core

ROOT = str(Path(__file__).resolve().parents[2])
PUPPET = puppet_core(before_ready="""
open(os.environ["PUPPET_RUNNING"], "w").write(str(os.getpid()))
while not os.path.exists(os.environ["PUPPET_GO"]):
    time.sleep(0.01)
""")


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


def test_serve_with_a_tokenizer_that_fails_is_one_line_and_leaves_no_core(tiny_model_dir, tmp_path, monkeypatch,
                                                                            capfd):
    """A tokenizer.json that is not JSON fails in the API server while the core starts beside it:
    `pagedserve serve` prints one line and exits 2, and the core it launched has exited without a
    traceback of its own (capfd: the core writes to this process's stderr)."""
    from pagedserve.entrypoints.cli import main
    model = tmp_path / "bad-tokenizer"
    shutil.copytree(tiny_model_dir("llama"), model)
    (model / "tokenizer.json").write_text("{ not json")
    launched = []

    class Recorded(subprocess.Popen):
        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            launched.append(self)
    monkeypatch.setattr(subprocess, "Popen", Recorded)
    monkeypatch.setenv("PYTHONPATH", ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    capfd.readouterr()
    try:
        rc = main(["serve", str(model), "--device", "cpu", "--max-model-len", "256"])
    except SystemExit as e:
        rc = e.code
    err = capfd.readouterr().err
    assert rc == 2, err
    assert err.strip().splitlines()[-1].startswith(
        f"pagedserve serve: error: tokenizer: cannot load a tokenizer from '{model}'"), err
    assert "Traceback" not in err and err.count("pagedserve serve: error") == 1, err
    assert len(launched) == 1 and "pagedserve.engine.core" in launched[0].args
    assert launched[0].poll() is not None  # stopped and reaped before serve returned


@pytest.fixture
def core_entry(tmp_path, monkeypatch):
    """run_engine_core in this process with its engine build replaced: yields (run, reader), where
    run(build) calls it with EngineCore = build and reader is the API server's end of its outputs."""
    import zmq

    from pagedserve.engine import core as core_mod
    monkeypatch.setattr(core_mod, "_exit_when_orphaned", lambda parent_pid: None)  # no watcher in pytest
    ctx = zmq.Context()
    reader = ctx.socket(zmq.PULL)
    reader.bind(f"ipc://{tmp_path}/out")
    ctx.socket(zmq.PUSH).bind(f"ipc://{tmp_path}/in")
    handlers = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)  # it sets both

    def run(build):
        monkeypatch.setattr(core_mod, "EngineCore", build)
        return core_mod.run_engine_core(EngineConfig(), f"ipc://{tmp_path}/in", f"ipc://{tmp_path}/out",
                                        os.getppid())
    yield run, reader
    signal.signal(signal.SIGINT, handlers[0])
    signal.signal(signal.SIGTERM, handlers[1])
    ctx.destroy(linger=0)


def test_a_core_stopped_mid_start_up_exits_quietly(core_entry, caplog):
    """SIGTERM while the engine builds (the API server stopped the core: its own start-up failed) is
    the handler's SystemExit there: the core re-raises it, logs no failure, sends no StartupFailed."""
    run, reader = core_entry

    def stopped(*a, **kw):
        raise SystemExit(0)  # what the core's SIGTERM handler raises wherever start-up is
    with pytest.raises(SystemExit), caplog.at_level(logging.ERROR):
        run(stopped)
    assert not reader.poll(500)  # no StartupFailed (a real failure sends one: the test below)
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR] == []


def test_a_core_that_fails_to_start_still_reports_it(core_entry):
    from pagedserve.engine.core_messages import Codec, StartupFailed
    run, reader = core_entry

    def broken(*a, **kw):
        raise RuntimeError("no such layer kind")
    assert run(broken) == 1
    assert reader.poll(5000)
    assert Codec().handshake.decode(reader.recv()) == StartupFailed("RuntimeError: no such layer kind")
