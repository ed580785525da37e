"""The long-prefill merge (attention/triton_merge.merge_parts_kernel) compiles for the H200 without
one, and at strides in units of 16 elements (triton_merge.merge_into's choice wherever head_dim is a
multiple of 16) moves its rows 16 bytes an access; its arithmetic is checked under the interpreter
(triton_interpret_cases.test_merge_kernel_matches_the_torch_merge)."""
import os

import pytest

if os.environ.get("TRITON_INTERPRET") == "1":
    pytest.skip("compiles for the GPU: not under the interpreter", allow_module_level=True)

from pagedserve.attention.triton_merge import MERGE_NUM_WARPS, MERGE_BLOCK_R, merge_parts_kernel  # noqa: E402
from sm90_compile import compile_sm90  # noqa: E402

POINTERS = {**{n: "*bf16" for n in ("o0", "o1", "o2", "out_ptr")}, **{n: "*fp32" for n in ("l0", "l1", "l2")}}


@pytest.mark.parametrize("parts", [2, 3])
def test_merge_kernel_moves_16_bytes_an_access_at_strides_in_units_of_16(parts):
    ptx = {unit: compile_sm90(merge_parts_kernel, dict(NUM_PARTS=parts, HEAD_DIM=128, BLOCK_D=128, BLOCK_R=MERGE_BLOCK_R,
                                                       STRIDE_UNIT=unit), POINTERS, num_warps=MERGE_NUM_WARPS[parts],
                              aligned=True)
           for unit in (16, 1)}
    # 16-byte loads of every part and stores of the output, none of 2 bytes ...
    assert "ld.global.v4.b32" in ptx[16] and "st.global.v4.b32" in ptx[16]
    assert "ld.global.b16" not in ptx[16] and "st.global.b16" not in ptx[16]
    # ... where strides in elements (alignment unknown to the compiler) move 2 bytes an access
    assert "ld.global.b16" in ptx[1] and "st.global.b16" in ptx[1]
