"""The FP8 KV decode's launch variants (BLOCK_N, warps, stages, the f16 cast) match reference.py
under the Triton interpreter on CPU: the cases (fp8_decode_interpret_cases.py) run in a subprocess
with TRITON_INTERPRET=1, beside the other case files (tests/interpreter_runs.py)."""
from pathlib import Path

import pytest
from interpreter_runs import assert_cases_passed

CASES = Path(__file__).with_name("fp8_decode_interpret_cases.py")


@pytest.mark.interpreter_cases(CASES, timeout=300)
def test_fp8_decode_variants_match_reference_under_interpreter(interpreter_run):
    proc = interpreter_run(CASES)
    assert_cases_passed(proc)
