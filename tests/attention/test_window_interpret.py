"""Sliding-window attention in the Triton kernels matches reference.py under the Triton interpreter
on CPU: its cases (window_interpret_cases.py) run in a subprocess with TRITON_INTERPRET=1, beside
the other interpreter case files (tests/interpreter_runs.py)."""
from pathlib import Path

import pytest
from interpreter_runs import assert_cases_passed

CASES = Path(__file__).with_name("window_interpret_cases.py")


@pytest.mark.interpreter_cases(CASES, timeout=300)
def test_window_kernels_match_reference_under_interpreter(interpreter_run):
    proc = interpreter_run(CASES)
    assert_cases_passed(proc)
