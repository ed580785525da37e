"""The Triton W8A8 GEMM (layers/quant/triton_fp8_gemm.py) against fp8_ops.fp8_gemm's reference
under the Triton interpreter on CPU (cases in fp8_gemm_interpret_cases.py). A subprocess, because
Triton reads TRITON_INTERPRET when @triton.jit decorates a function (at import)."""
import os
import subprocess
import sys
from pathlib import Path

import triton  # noqa: F401  (a pinned dev dependency: missing must fail, not skip)

HERE = Path(__file__).parent
ROOT = HERE.parents[1]


def test_triton_fp8_gemm_matches_reference_under_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1")
    env.pop("PAGEDSERVE_FP8_GEMM", None)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           str(HERE / "fp8_gemm_interpret_cases.py")],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-8000:] + proc.stderr[-2000:]
    assert " passed" in proc.stdout and "skipped" not in proc.stdout, proc.stdout[-2000:]
