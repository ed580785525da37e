"""pagedserve/benchmark/server_process.py against real processes: a stdlib HTTP server that
answers, one that exits, one that never listens, and a process group with a child."""
from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pagedserve.benchmark.server_process import free_port, stop_process, wait_until_ready


def _gone(pid: int) -> bool:
    """True once `pid` no longer runs (absent, or a zombie waiting for init)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def test_ready_once_the_url_answers(tmp_path):
    (tmp_path / "health").write_text('{"status": "ok"}')
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1"],
                            cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_until_ready(proc, f"http://127.0.0.1:{port}/health", 60,
                         ready=lambda r: r.json()["status"] == "ok")
        assert proc.poll() is None
    finally:
        stop_process(proc, timeout=10)
    assert proc.returncode == -signal.SIGTERM


def test_a_server_that_exits_names_its_code_and_log(tmp_path):
    log = tmp_path / "server.log"
    with open(log, "w") as f:
        proc = subprocess.Popen([sys.executable, "-c", "print('bad flag --foo'); raise SystemExit(3)"],
                                stdout=f, stderr=subprocess.STDOUT)
    with pytest.raises(RuntimeError, match=r"exited with 3\n.*bad flag --foo"):
        wait_until_ready(proc, f"http://127.0.0.1:{free_port()}/health", 60, log_path=log)


def test_timeout_leaves_the_process_to_the_caller():
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        with pytest.raises(RuntimeError, match="not ready"):
            wait_until_ready(proc, f"http://127.0.0.1:{free_port()}/health", 0.5, interval=0.1)
        assert proc.poll() is None
    finally:
        stop_process(proc, timeout=10)
    assert proc.returncode == -signal.SIGTERM
    stop_process(proc)  # already reaped: nothing to do, no error


def test_group_stop_takes_the_children_along():
    # The parent ignores SIGTERM, so only the SIGKILL after the timeout ends it.
    code = ("import signal, subprocess, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
            "c = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
            "print(c.pid, flush=True); time.sleep(60)")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                            start_new_session=True)
    child = int(proc.stdout.readline())
    stop_process(proc, timeout=1, group=True)
    assert proc.returncode == -signal.SIGKILL
    deadline = time.monotonic() + 10
    while not _gone(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _gone(child)


def test_process_cpu_seconds_counts_a_childs_busy_time_and_fails_once_it_is_gone():
    from pagedserve.benchmark.server_process import process_cpu_seconds
    busy = subprocess.Popen([sys.executable, "-c", "import time\nt = time.process_time()\n"
                             "while time.process_time() - t < 0.5: pass\nprint('done', flush=True)\ninput()"],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert busy.stdout.readline().strip() == "done"  # 0.5 s of its own CPU spent, still alive
        assert 0.45 <= process_cpu_seconds(busy.pid) < 5
    finally:
        busy.communicate("\n", timeout=30)
    with pytest.raises(OSError):
        process_cpu_seconds(busy.pid)
