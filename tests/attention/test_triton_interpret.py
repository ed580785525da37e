"""The Triton kernels match reference.py under the Triton interpreter on CPU (tiny sizes).

The cases live in triton_interpret_cases.py and run here in a subprocess with
TRITON_INTERPRET=1: Triton reads that switch when @triton.jit decorates a function (at
import), so setting it in this process would leak into every later test module.
"""
import os
import subprocess
import sys
from pathlib import Path

import triton  # noqa: F401  (a pinned dev dependency: missing must fail, not skip)

CASES = Path(__file__).with_name("triton_interpret_cases.py")
ROOT = Path(__file__).resolve().parents[2]


def test_triton_kernels_match_reference_under_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(CASES)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-8000:] + proc.stderr[-2000:]
    assert " passed" in proc.stdout and "skipped" not in proc.stdout, proc.stdout[-2000:]
