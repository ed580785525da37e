"""The Triton kernels match reference.py under the Triton interpreter on CPU (tiny sizes).

The cases live in triton_interpret_cases.py and run in a subprocess with TRITON_INTERPRET=1:
Triton reads that switch when @triton.jit decorates a function (at import), so setting it in
this process would leak into every later test module. The subprocess runs beside the other
interpreter case files (tests/interpreter_runs.py).
"""
from pathlib import Path

import pytest
import triton  # noqa: F401  (a pinned dev dependency: missing must fail, not skip)
from interpreter_runs import assert_cases_passed

CASES = Path(__file__).with_name("triton_interpret_cases.py")


@pytest.mark.interpreter_cases(CASES, timeout=300)
def test_triton_kernels_match_reference_under_interpreter(interpreter_run):
    proc = interpreter_run(CASES)
    assert_cases_passed(proc)
