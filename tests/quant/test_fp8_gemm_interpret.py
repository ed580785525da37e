"""The Triton W8A8 GEMM (layers/quant/triton_fp8_gemm.py) against fp8_ops.fp8_gemm's reference
under the Triton interpreter on CPU (cases in fp8_gemm_interpret_cases.py). A subprocess, because
Triton reads TRITON_INTERPRET when @triton.jit decorates a function (at import); it runs beside the
other interpreter case files (tests/interpreter_runs.py), with the GEMM switch unset."""
from pathlib import Path

import pytest
import triton  # noqa: F401  (a pinned dev dependency: missing must fail, not skip)
from interpreter_runs import assert_cases_passed

CASES = Path(__file__).parent / "fp8_gemm_interpret_cases.py"


@pytest.mark.interpreter_cases(CASES, env_drop=("PAGEDSERVE_FP8_GEMM",))
def test_triton_fp8_gemm_matches_reference_under_interpreter(interpreter_run):
    proc = interpreter_run(CASES)
    assert_cases_passed(proc)
