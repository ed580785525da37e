"""Run the Triton-interpreter case files side by side instead of one after another.

Each case file (tests/{attention,layers,quant}/*_interpret_cases.py) runs in a
subprocess with TRITON_INTERPRET=1, because Triton picks interpreter-or-compiler when @triton.jit
decorates a function (at import): setting it in this process would leak into every later test.
Those subprocesses are single-threaded Python (the interpreter walks every program of the grid),
so on an N-core machine N of them run in the time of one. The first test that needs a case file
starts every case file this session will need (read from the collected tests' markers), at most
one per core, longest first, and waits until all of them are done: nothing runs beside the other
tests. Each test then checks its own file's result exactly as it did when it ran it alone.

Mark a test with @pytest.mark.interpreter_cases(path, env_drop=(...)) and take the fixture
`interpreter_run` (tests/conftest.py): `interpreter_run(path)` is the CompletedProcess of that file.
"""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# Solo wall seconds on the 2-core CI machine (last measured): only the start order uses them, so
# that the longest runs do not end up last.
EXPECTED_S = {"triton_interpret_cases.py": 40, "sampling_interpret_cases.py": 37, "fused_interpret_cases.py": 23,
              "unified_interpret_cases.py": 17, "moe_interpret_cases.py": 14, "fp8_gemm_interpret_cases.py": 7,
              "fp8_decode_interpret_cases.py": 9}


@dataclass
class CaseRun:
    path: Path
    env_drop: tuple[str, ...] = ()
    timeout: float = 600.0
    proc: subprocess.Popen | None = None
    out: object = None
    err: object = None
    started: float = 0.0
    result: subprocess.CompletedProcess | None = field(default=None, repr=False)

    def env(self) -> dict:
        # One intra-op thread each: the runs share the cores among themselves.
        env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1")
        for name in self.env_drop:
            env.pop(name, None)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
        return env

    def start(self) -> None:
        # Files, not pipes: nobody reads a pipe while the run fills it.
        self.out, self.err = tempfile.TemporaryFile(mode="w+"), tempfile.TemporaryFile(mode="w+")
        self.proc = subprocess.Popen([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(self.path)],
                                     cwd=ROOT, env=self.env(), stdout=self.out, stderr=self.err, text=True)
        self.started = time.monotonic()

    def poll(self) -> bool:
        """True once finished (or killed for running past its timeout)."""
        if self.result is not None:
            return True
        rc = self.proc.poll()
        if rc is None and time.monotonic() - self.started > self.timeout:
            self.proc.kill()
            rc = self.proc.wait()
            self.err.write(f"\n[killed after {self.timeout:.0f} s]\n")
        if rc is None:
            return False
        texts = []
        for f in (self.out, self.err):
            f.seek(0)
            texts.append(f.read())
            f.close()
        self.result = subprocess.CompletedProcess(self.proc.args, rc, stdout=texts[0], stderr=texts[1])
        return True

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def assert_cases_passed(proc: subprocess.CompletedProcess) -> None:
    """A case file's run passed: exit 0, some test passed, none skipped (a case file whose tests
    all skip, e.g. for want of an import, must not pass as a success)."""
    assert proc.returncode == 0, proc.stdout[-8000:] + proc.stderr[-2000:]
    assert " passed" in proc.stdout and "skipped" not in proc.stdout, proc.stdout[-2000:]


class InterpreterRuns:
    """The case files of this session, run at most `jobs` at a time on the first request."""

    def __init__(self, runs: list[CaseRun], jobs: int) -> None:
        self.runs = {r.path.resolve(): r for r in runs}
        self.jobs = max(1, jobs)
        self.done = False

    def run_all(self) -> None:
        pending = sorted((r for r in self.runs.values() if r.result is None),
                         key=lambda r: -EXPECTED_S.get(r.path.name, 30))
        running: list[CaseRun] = []
        while pending or running:
            while pending and len(running) < self.jobs:
                run = pending.pop(0)
                run.start()
                running.append(run)
            time.sleep(0.2)
            running = [r for r in running if not r.poll()]
        self.done = True

    def __call__(self, path: Path | str) -> subprocess.CompletedProcess:
        key = Path(path).resolve()
        if key not in self.runs:  # a test not seen at collection (e.g. called by name): run it alone
            self.runs[key] = CaseRun(key)
            self.done = False
        if not self.done:
            self.run_all()
        return self.runs[key].result

    def close(self) -> None:
        for r in self.runs.values():
            r.kill()
