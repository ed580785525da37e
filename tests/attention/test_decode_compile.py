"""The decode kernels compile for the H200 without one: Triton builds them ahead of time for sm_90
with its bundled ptxas, in every split mode and with and without the longest-first order. The
interpreter (triton_interpret_cases.py) checks the arithmetic but not the compiler's rules: a
value two branches give different types (int32 against an int64 from the order) compiles under
the interpreter and fails here, as it did once in the 41st session."""
import os

import pytest

if os.environ.get("TRITON_INTERPRET") == "1":
    pytest.skip("compiles for the GPU: not under the interpreter", allow_module_level=True)

from pagedserve.attention import decode_plan  # noqa: E402
from pagedserve.attention.triton_decode import paged_decode_kernel, reduce_splits_kernel  # noqa: E402
from sm90_compile import compile_sm90  # noqa: E402

POINTERS = {"q_ptr": "*bf16", "k_cache_ptr": "*bf16", "v_cache_ptr": "*bf16", "out_ptr": "*bf16",
            "mid_o_ptr": "*fp32", "mid_lse_ptr": "*fp32", "seq_lens_ptr": "*i32", "block_tables_ptr": "*i32",
            "qk_scale": "fp32", "order_ptr": "*i64", "full_lens_ptr": "*i32"}
PLAN = dict(SHARE_PROGRAMS=792, MIN_CHAIN_TILES=2)


def _compile(fn, const: dict) -> str:
    return compile_sm90(fn, const, POINTERS)


@pytest.mark.parametrize("window,softcap", [(0, 0.0), (4096, 50.0)])
@pytest.mark.parametrize("split_tokens", [decode_plan.SLOTS, decode_plan.BALANCED, 0, 512])
@pytest.mark.parametrize("ordered", [False, True])
def test_decode_and_reduce_compile_for_sm90(split_tokens, ordered, window, softcap):
    """window: a sliding window's variant (its full lengths read beside the clamped ones), here
    with Gemma 2's soft cap."""
    order = {} if ordered else {"order_ptr": None}
    windowed = dict(WINDOW=window, SOFTCAP=softcap) if window else dict(WINDOW=0, SOFTCAP=0.0, full_lens_ptr=None)
    ptx = _compile(paged_decode_kernel, dict(
        GROUP=4, HEAD_DIM=128, BLOCK_SIZE=16, BLOCK_G=16, BLOCK_D=128, BLOCK_N=128, SPLIT_TOKENS=split_tokens,
        IEEE=False, HEADS_FASTEST=True, k_scale_ptr=None, v_scale_ptr=None, KV_FP8=False, KV_SCALE_PER_HEAD=False,
        F16_DOT=False, **PLAN, **order, **windowed))
    assert "mma" in ptx  # the tiles' dots on the tensor cores
    _compile(reduce_splits_kernel, dict(HEAD_DIM=128, BLOCK_D=128, BLOCK_N=128, SPLIT_TOKENS=split_tokens,
                                        BLOCK_S=16, **PLAN, **order))
