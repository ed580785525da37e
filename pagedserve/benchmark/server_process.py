"""A server process for a benchmark or test: a free port, wait until it answers, stop it (bounded),
the CPU time it spent.

Shared by benchmarks/*.py, scripts/ and the server tests. Servers started with
`start_new_session=True` are stopped as a process group (`group=True`), so rank 0's TP workers
and DP replicas go with it.
"""
from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Any, Callable

import httpx

from pagedserve.runner.dist_env import free_port

__all__ = ["free_port", "stop_process", "wait_until_ready"]


def _tail(log_path: Path | None, chars: int) -> str:
    if log_path is None:
        return ""
    try:
        return "\n" + log_path.read_text(errors="replace")[-chars:]
    except OSError:
        return ""


def wait_until_ready(proc: subprocess.Popen, url: str, timeout: float, *, interval: float = 0.3,
                     request_timeout: float = 2.0, ready: Callable[[httpx.Response], bool] | None = None,
                     log_path: Path | None = None, log_chars: int = 5000, verify: Any = True) -> None:
    """Poll `url` until it answers 200 (and `ready(response)` holds, when given).

    Raises RuntimeError if `proc` exits first or `timeout` seconds pass; the message ends with the
    last `log_chars` characters of `log_path` when one is given. Leaves `proc` running either way.
    """
    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}{_tail(log_path, log_chars)}")
        try:
            r = httpx.get(url, timeout=request_timeout, verify=verify)
            if r.status_code == 200 and (ready is None or ready(r)):
                return
        except (httpx.HTTPError, ValueError):  # not listening yet; a body that is not JSON yet
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"server not ready at {url} within {timeout} s{_tail(log_path, log_chars)}")
        time.sleep(interval)


def stop_process(proc: subprocess.Popen, timeout: float = 30.0, *, group: bool = False) -> None:
    """SIGTERM (to the whole process group when `group`), wait up to `timeout` s, then SIGKILL the
    same way and reap. A process that is already gone is fine."""
    def send(sig: int) -> None:
        try:
            if group:
                os.killpg(proc.pid, sig)
            else:
                proc.send_signal(sig)  # a no-op once the process has been reaped
        except ProcessLookupError:
            pass

    send(signal.SIGTERM)
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        send(signal.SIGKILL)
        proc.wait()


def process_cpu_seconds(pid: int) -> float:
    """user + system CPU time of a process (not its children), from /proc/PID/stat (Linux);
    OSError once the process is gone."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()  # the command name may hold spaces and ')'
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
