"""The fused Triton layer ops (pagedserve/layers/triton_fused.py) match the plain-torch path
under the Triton interpreter on CPU; see fused_interpret_cases.py for the cases and tolerances.

Run in a subprocess with TRITON_INTERPRET=1: Triton reads that switch when @triton.jit
decorates a function (at import), so setting it here would leak into later test modules.
"""
import os
import subprocess
import sys
from pathlib import Path

import triton  # noqa: F401  (a pinned dev dependency: missing must fail, not skip)

CASES = Path(__file__).with_name("fused_interpret_cases.py")
ROOT = Path(__file__).resolve().parents[2]


def test_fused_ops_match_torch_under_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1")
    env.pop("PAGEDSERVE_FUSED", None)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(CASES)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-8000:] + proc.stderr[-2000:]
    assert " passed" in proc.stdout and "skipped" not in proc.stdout, proc.stdout[-2000:]
