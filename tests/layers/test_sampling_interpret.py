"""The fused plain-path sampling kernels (pagedserve/layers/triton_sampling.py) against torch under
the Triton interpreter on CPU; see sampling_interpret_cases.py for the cases and why each holds.

Run in a subprocess with TRITON_INTERPRET=1: Triton reads that switch when @triton.jit
decorates a function (at import), so setting it here would leak into later test modules.
"""
import os
import subprocess
import sys
from pathlib import Path

import triton  # noqa: F401  (a pinned dev dependency: missing must fail, not skip)

CASES = Path(__file__).with_name("sampling_interpret_cases.py")
ROOT = Path(__file__).resolve().parents[2]


def test_fused_sampling_matches_torch_under_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1")
    for var in ("PAGEDSERVE_FUSED", "PAGEDSERVE_FUSED_SAMPLING"):
        env.pop(var, None)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), str(ROOT / "tests"), env.get("PYTHONPATH")) if p)
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(CASES)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-8000:] + proc.stderr[-2000:]
    assert " passed" in proc.stdout and "skipped" not in proc.stdout, proc.stdout[-2000:]
