"""Run the Triton-interpreter case files beside the rest of the suite, a few pytest processes for all of them.

Each case file (tests/{attention,layers,quant}/*_interpret_cases.py) runs in a
subprocess with TRITON_INTERPRET=1, because Triton picks interpreter-or-compiler when @triton.jit
decorates a function (at import): setting it in this process would leak into every later test.
Those subprocesses are single-threaded Python (the interpreter walks every program of the grid).
At the end of collection (tests/conftest.py) every case file the session will need (read from the
collected tests' markers) is split into processes balanced by their expected times and started,
at a lower priority, and the tests that check them are moved to the end of the run: the rest of
the suite runs meanwhile. On average it keeps about one core busy (its servers, engines and clients
mostly wait on each other), so on a 2-core machine the interpreter's ~4 minutes of work fit beside
it in one process instead of holding up everything else for ~2 minutes in two. One process per
spare core (all cores when nothing else runs), not per file: each process spends ~5 s importing
torch, triton and pagedserve and collecting, and a file run alone paid that every time.
Each test then checks its own file's result, read from the process's JUnit XML: the file's own
test cases, passed, failed or skipped, whatever the other files in its process did.

Mark a test with @pytest.mark.interpreter_cases(path, env_drop=(...)) and take the fixture
`interpreter_run` (tests/conftest.py): `interpreter_run(path)` is the CompletedProcess of that file
(its returncode and a summary of its own cases; the process's whole output when it failed).
"""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# Seconds of each file's own cases (their JUnit times) in two grouped processes on a 2-core machine,
# last measured 2026-12-06 (the sampling cases had grown to 63 s from the 25 written here before, so
# one process ran 129 s of cases beside the other's 101): only the split into processes uses them,
# so that the processes take about as long as each other (a file after another that interprets the
# same kernels is cheaper: hence fp8_decode's).
EXPECTED_S = {"triton_interpret_cases.py": 82, "sampling_interpret_cases.py": 63, "fused_interpret_cases.py": 35,
              "moe_interpret_cases.py": 9, "unified_interpret_cases.py": 11, "fp8_decode_interpret_cases.py": 3,
              "fp8_gemm_interpret_cases.py": 2, "window_interpret_cases.py": 26}


@dataclass
class CaseRun:
    """One case file: what it needs (environment variables removed, a time limit) and its result."""
    path: Path
    env_drop: tuple[str, ...] = ()
    timeout: float = 600.0
    result: subprocess.CompletedProcess | None = field(default=None, repr=False)

    @property
    def expected_s(self) -> float:
        return EXPECTED_S.get(self.path.name, 30)

    @property
    def module(self) -> str:
        """Its dotted name as pytest's JUnit XML writes it (rootdir-relative)."""
        return ".".join(self.path.resolve().relative_to(ROOT).with_suffix("").parts)


@dataclass
class GroupRun:
    """Some case files in one pytest process; each file's own result comes from the JUnit XML."""
    members: list[CaseRun]
    proc: subprocess.Popen | None = None
    out: object = None
    err: object = None
    junit: Path | None = None
    started: float = 0.0
    done: bool = False

    @property
    def timeout(self) -> float:
        """The members' limits added up: they run one after another in this process."""
        return sum(m.timeout for m in self.members)

    def env(self) -> dict:
        # One intra-op thread each: the processes share the cores among themselves. The variables
        # any member wants gone are gone for all (switches each file decides for itself).
        env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1")
        for m in self.members:
            for name in m.env_drop:
                env.pop(name, None)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
        return env

    def start(self) -> None:
        # Files, not pipes: nobody reads a pipe while the run fills it.
        self.out, self.err = tempfile.TemporaryFile(mode="w+"), tempfile.TemporaryFile(mode="w+")
        fd, name = tempfile.mkstemp(prefix="interpreter-", suffix=".xml")
        os.close(fd)
        self.junit = Path(name)
        # A file that fails to import must not keep the others of its process from running.
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--continue-on-collection-errors",
               "-o", "junit_family=xunit1", f"--junitxml={self.junit}", *(str(m.path) for m in self.members)]
        self.proc = subprocess.Popen(cmd, cwd=ROOT, env=self.env(), stdout=self.out, stderr=self.err, text=True)
        self.started = time.monotonic()

    def poll(self) -> bool:
        """True once finished (or killed for running past its timeout); then every member has its result."""
        if self.done:
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
        self._split_results(rc, *texts)
        self.junit.unlink(missing_ok=True)
        self.done = True
        return True

    def _split_results(self, rc: int, stdout: str, stderr: str) -> None:
        """Each member's CompletedProcess: its own cases' outcome when the process ended normally
        (exit 0, or 1: some case somewhere failed); the process's exit and output otherwise."""
        whole = subprocess.CompletedProcess(self.proc.args, rc if rc else 1, stdout=stdout, stderr=stderr)
        try:
            cases = list(ET.parse(self.junit).getroot().iter("testcase")) if rc in (0, 1) else None
        except (ET.ParseError, OSError):
            cases = None
        for m in self.members:
            if cases is None:  # crashed, killed, interrupted: nothing to split
                m.result = whole
                continue
            mine = [c for c in cases if _case_module(c) == m.module]
            failed = [c for c in mine if c.find("failure") is not None or c.find("error") is not None]
            skipped = [c for c in mine if c.find("skipped") is not None]
            passed = len(mine) - len(failed) - len(skipped)
            summary = f"{m.path.name}: {passed} passed" + (f", {len(skipped)} skipped" if skipped else "") + \
                (f", {len(failed)} failed" if failed else "")
            if failed or not mine:
                details = "\n\n".join(f"{c.get('name')}:\n{_case_text(c)}" for c in failed)
                m.result = subprocess.CompletedProcess(self.proc.args, 1, stdout=f"{details}\n{summary}\n{stdout}",
                                                       stderr=stderr)
            else:
                m.result = subprocess.CompletedProcess(self.proc.args, 0, stdout=summary + "\n", stderr="")

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        if self.junit is not None:
            self.junit.unlink(missing_ok=True)


def _case_module(case: ET.Element) -> str:
    """The dotted module of a JUnit test case: from its file, or (a collection error or a module-level
    skip, which have none) from its classname or name."""
    if case.get("file"):
        return ".".join(Path(case.get("file")).with_suffix("").parts)
    return case.get("classname") or case.get("name") or ""


def _case_text(case: ET.Element) -> str:
    el = case.find("failure") if case.find("failure") is not None else case.find("error")
    return ((el.get("message") or "") + "\n" + (el.text or ""))[-6000:]


def assert_cases_passed(proc: subprocess.CompletedProcess) -> None:
    """A case file's run passed: exit 0, some test passed, none skipped (a case file whose tests
    all skip, e.g. for want of an import, must not pass as a success)."""
    assert proc.returncode == 0, proc.stdout[-8000:] + proc.stderr[-2000:]
    assert " passed" in proc.stdout and "skipped" not in proc.stdout, proc.stdout[-2000:]


def split_by_expected_time(runs: list[CaseRun], jobs: int) -> list[list[CaseRun]]:
    """At most `jobs` groups, longest file first into the group expected to finish first."""
    groups: list[list[CaseRun]] = [[] for _ in range(max(1, min(jobs, len(runs))))]
    for run in sorted(runs, key=lambda r: -r.expected_s):
        min(groups, key=lambda g: sum(r.expected_s for r in g)).append(run)
    return [g for g in groups if g]


class InterpreterRuns:
    """The case files of this session, in at most `jobs` processes, started by start() (or by the
    first request for a result)."""

    def __init__(self, runs: list[CaseRun], jobs: int) -> None:
        self.runs = {r.path.resolve(): r for r in runs}
        self.jobs = max(1, jobs)
        self.groups: list[GroupRun] = []

    def start(self) -> None:
        """Starts every file without a result or a process yet, at nice 10: beside the other tests,
        the interpreter takes the cores they leave idle, not the ones they use."""
        started = {id(m) for g in self.groups for m in g.members}
        pending = [r for r in self.runs.values() if r.result is None and id(r) not in started]
        for members in split_by_expected_time(pending, self.jobs):
            group = GroupRun(members)
            group.start()
            try:
                os.setpriority(os.PRIO_PROCESS, group.proc.pid, 10)
            except OSError:  # already gone, or not allowed: it only runs at the usual priority
                pass
            self.groups.append(group)

    def __call__(self, path: Path | str) -> subprocess.CompletedProcess:
        key = Path(path).resolve()
        if key not in self.runs:  # a test not seen at collection (e.g. called by name): run it alone
            self.runs[key] = CaseRun(key)
        run = self.runs[key]
        if run.result is None:
            self.start()
            group = next(g for g in self.groups if run in g.members)
            while not group.poll():  # the group checks its own timeout
                time.sleep(0.2)
        return run.result

    def close(self) -> None:
        for g in self.groups:
            g.kill()
