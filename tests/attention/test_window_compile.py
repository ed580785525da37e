"""The prefill and unified kernels compile for the H200 without one (Triton's bundled ptxas, as
test_decode_compile.py), with and without a sliding window and Gemma 2's soft cap: the interpreter
(window_interpret_cases.py) checks their arithmetic, this the compiler's rules."""
import os

import pytest

if os.environ.get("TRITON_INTERPRET") == "1":
    pytest.skip("compiles for the GPU: not under the interpreter", allow_module_level=True)

from pagedserve.attention.triton_prefill import paged_prefill_kernel  # noqa: E402
from pagedserve.attention.triton_unified import unified_attention_kernel  # noqa: E402
from sm90_compile import compile_sm90  # noqa: E402

POINTERS = {"q_ptr": "*bf16", "k_cache_ptr": "*bf16", "v_cache_ptr": "*bf16", "out_ptr": "*bf16",
            "mid_o_ptr": "*fp32", "mid_lse_ptr": "*fp32", "items_ptr": "*i32", "query_start_loc_ptr": "*i32",
            "seq_lens_ptr": "*i32", "block_tables_ptr": "*i32", "qk_scale": "fp32"}
NO_FP8 = dict(k_scale_ptr=None, v_scale_ptr=None, KV_FP8=False, KV_SCALE_PER_HEAD=False)


@pytest.mark.parametrize("window,softcap", [(0, 0.0), (4096, 0.0), (4096, 50.0)])
@pytest.mark.parametrize("gqa", [False, True])
def test_prefill_compiles_for_sm90(window, softcap, gqa):
    pack = dict(GQA=True, BLOCK_G=4) if gqa else dict(GQA=False, BLOCK_G=1)
    ptx = compile_sm90(paged_prefill_kernel, dict(
        GROUP=4, HEAD_DIM=128, BLOCK_SIZE=16, BLOCK_M=128, BLOCK_D=128, BLOCK_N=64, IEEE=False, LONGEST_FIRST=False,
        k_desc=None, v_desc=None, TMA=False, WS=False, WINDOW=window, SOFTCAP=softcap, **pack, **NO_FP8), POINTERS,
        num_warps=8)
    assert "mma" in ptx


@pytest.mark.parametrize("window,softcap", [(0, 0.0), (4096, 0.0), (0, 50.0)])
def test_unified_compiles_for_sm90(window, softcap):
    ptx = compile_sm90(unified_attention_kernel, dict(
        GROUP=4, HEAD_DIM=128, BLOCK_SIZE=16, BLOCK_Q=16, BLOCK_G=4, BLOCK_D=128, BLOCK_N=64, IEEE=False,
        WINDOW=window, SOFTCAP=softcap, **NO_FP8), POINTERS)
    assert "mma" in ptx
