"""The fused Triton kernels match the plain-torch path under the Triton interpreter on CPU: the layer
ops (pagedserve/layers/triton_fused.py; cases and tolerances in fused_interpret_cases.py) and the
plain-path sampling (pagedserve/layers/triton_sampling.py; sampling_interpret_cases.py).

Each case file runs in a subprocess with TRITON_INTERPRET=1: Triton reads that switch when
@triton.jit decorates a function (at import), so setting it here would leak into later test modules.
The subprocesses run beside the other interpreter case files (tests/interpreter_runs.py), with the
fused switches unset so that each file decides them itself.
"""
from pathlib import Path

import pytest
import triton  # noqa: F401  (a pinned dev dependency: missing must fail, not skip)
from interpreter_runs import assert_cases_passed

HERE = Path(__file__).parent
SWITCHES = ("PAGEDSERVE_FUSED", "PAGEDSERVE_FUSED_SAMPLING", "PAGEDSERVE_FUSED_MOE")
CASE_FILES = ["fused_interpret_cases.py", "sampling_interpret_cases.py", "moe_interpret_cases.py"]


@pytest.mark.parametrize("cases", [pytest.param(c, marks=pytest.mark.interpreter_cases(HERE / c, env_drop=SWITCHES))
                                   for c in CASE_FILES])
def test_fused_kernels_match_torch_under_interpreter(cases, interpreter_run):
    proc = interpreter_run(HERE / cases)
    assert_cases_passed(proc)
