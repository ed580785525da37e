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


@pytest.mark.parametrize("greedy", [True, False])
def test_span_kernel_reads_16_bytes_an_access_at_unit_16(greedy):
    """With the row stride and the vocabulary in units of 16 (logits_unit's choice for Llama's,
    Qwen's, Mistral's vocabularies) and the aligned pointer a launch specializes on, the logits are
    read 16 bytes an access; in units of 1 the compiler cannot prove a span aligned: 2 bytes."""
    ptx = {unit: compile_sm90(ts._span_kernel, dict(GREEDY=greedy, BLOCK=ts.GREEDY_BLOCK if greedy else ts.BLOCK,
                                                    UNIT=unit), POINTERS, num_warps=ts.NUM_WARPS, aligned=True)
           for unit in (16, 1)}
    assert "ld.global.v4.b32" in ptx[16] and "ld.global.b16" not in ptx[16]
    assert "ld.global.b16" in ptx[1] and "ld.global.v4.b32" not in ptx[1]


def test_merge_kernel_compiles_for_sm90():
    compile_sm90(ts._merge_kernel, dict(SPLITS=ts.MAX_SPLITS), POINTERS, num_warps=1)
