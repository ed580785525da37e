"""The fused Triton kernels match the plain-torch path under the Triton interpreter on CPU: the layer
ops (pagedserve/layers/triton_fused.py; cases and tolerances in fused_interpret_cases.py) and the
plain-path sampling (pagedserve/layers/triton_sampling.py; sampling_interpret_cases.py).

Each case file runs in a subprocess with TRITON_INTERPRET=1: Triton reads that switch when
@triton.jit decorates a function (at import), so setting it here would leak into later test modules.
"""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import triton  # noqa: F401  (a pinned dev dependency: missing must fail, not skip)

HERE = Path(__file__).parent
ROOT = HERE.parents[1]


@pytest.mark.parametrize("cases", ["fused_interpret_cases.py", "sampling_interpret_cases.py", "moe_interpret_cases.py"])
def test_fused_kernels_match_torch_under_interpreter(cases):
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1")
    for switch in ("PAGEDSERVE_FUSED", "PAGEDSERVE_FUSED_SAMPLING", "PAGEDSERVE_FUSED_MOE"):
        env.pop(switch, None)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(HERE / cases)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-8000:] + proc.stderr[-2000:]
    assert " passed" in proc.stdout and "skipped" not in proc.stdout, proc.stdout[-2000:]
