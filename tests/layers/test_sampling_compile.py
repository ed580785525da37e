"""The fused sampling kernels (pagedserve/layers/triton_sampling.py) compile for the H200 without
one, greedy and with temperature (Philox's four outputs joined and reshaped into the block), at
the launch's warps. Their arithmetic: sampling_interpret_cases.py under the interpreter."""
import os

import pytest

if os.environ.get("TRITON_INTERPRET") == "1":
    pytest.skip("compiles for the GPU: not under the interpreter", allow_module_level=True)

from pagedserve.layers import triton_sampling as ts  # noqa: E402
from sm90_compile import compile_sm90  # noqa: E402

POINTERS = {"logits_ptr": "*bf16", "temps_ptr": "*fp32", "part_ptr": "*fp32", "tokens_ptr": "*i64",
            "packed_ptr": "*fp64"}


@pytest.mark.parametrize("greedy", [True, False])
def test_span_kernel_compiles_for_sm90(greedy):
    ptx = compile_sm90(ts._span_kernel, dict(GREEDY=greedy, BLOCK=ts.BLOCK), POINTERS, num_warps=8)
    # Philox's rounds are 32-bit high multiplies; greedy has none
    assert ("mul.hi.u32" in ptx) != greedy


def test_merge_kernel_compiles_for_sm90():
    compile_sm90(ts._merge_kernel, dict(SPLITS=ts.MAX_SPLITS), POINTERS, num_warps=1)
