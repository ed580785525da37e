"""The attention kernels move their query rows, outputs and split results 16 bytes an access when
their unspecialized row strides come in units of 16 (host_math.stride_unit's choice for any
head_dim a multiple of 16), and 2 bytes (bf16) an access in elements, where the compiler cannot
prove a row aligned. Built for sm_90 on CPU as a launch specializes: pointers 16-byte aligned and
the strides Triton may specialize (the pool's, the head strides) known multiples of 16. The K/V
tiles move by cp.async either way. Arithmetic at both units: the interpreter cases
(test_split_k_decode_reads_strided_rows_in_units_of_16_or_not and the strided-output cases)."""
import os

import pytest

if os.environ.get("TRITON_INTERPRET") == "1":
    pytest.skip("compiles for the GPU: not under the interpreter", allow_module_level=True)

from pagedserve.attention import decode_plan  # noqa: E402
from pagedserve.attention.triton_decode import paged_decode_kernel, reduce_splits_kernel  # noqa: E402
from pagedserve.attention.triton_prefill import paged_prefill_kernel  # noqa: E402
from pagedserve.attention.triton_unified import reduce_tiles_kernel, unified_attention_kernel  # noqa: E402
from sm90_compile import compile_sm90  # noqa: E402

POINTERS = {"q_ptr": "*bf16", "k_cache_ptr": "*bf16", "v_cache_ptr": "*bf16", "out_ptr": "*bf16",
            "mid_o_ptr": "*fp32", "mid_lse_ptr": "*fp32", "seq_lens_ptr": "*i32", "block_tables_ptr": "*i32",
            "items_ptr": "*i32", "query_start_loc_ptr": "*i32", "qtiles_ptr": "*i32", "qk_scale": "fp32",
            "order_ptr": "*i64"}
SPECIALIZED = ("stride_qh", "stride_oh", "stride_cb", "stride_cs", "stride_ch")
NO_FP8 = dict(k_scale_ptr=None, v_scale_ptr=None, KV_FP8=False, KV_SCALE_PER_HEAD=False)
PLAN = dict(SHARE_PROGRAMS=792, MIN_CHAIN_TILES=2)


def _ptx(fn, const: dict, num_warps: int = 4, divisible=SPECIALIZED) -> dict[int, str]:
    return {unit: compile_sm90(fn, dict(const, STRIDE_UNIT=unit), POINTERS, num_warps=num_warps, aligned=True,
                               divisible=divisible) for unit in (16, 1)}


def _moves_rows_16_bytes_only_at_unit_16(ptx: dict[int, str]):
    assert "ld.global.b16" not in ptx[16] and "st.global.b16" not in ptx[16]
    assert "ld.global.v4.b32" in ptx[16] and "st.global.v4.b32" in ptx[16]
    assert "ld.global.b16" in ptx[1] and "st.global.b16" in ptx[1]


@pytest.mark.parametrize("split_tokens", [decode_plan.SLOTS, decode_plan.BALANCED])
def test_decode_and_its_reduce(split_tokens):
    ptx = _ptx(paged_decode_kernel, dict(
        GROUP=4, HEAD_DIM=128, BLOCK_SIZE=16, BLOCK_G=16, BLOCK_D=128, BLOCK_N=128, SPLIT_TOKENS=split_tokens,
        IEEE=False, HEADS_FASTEST=True, F16_DOT=False, WINDOW=0, SOFTCAP=0.0, full_lens_ptr=None, **NO_FP8, **PLAN))
    _moves_rows_16_bytes_only_at_unit_16(ptx)
    assert "st.global.v4.b32" not in ptx[1]  # the fp32 split results too
    reduce = _ptx(reduce_splits_kernel, dict(HEAD_DIM=128, BLOCK_D=128, BLOCK_N=128, SPLIT_TOKENS=split_tokens,
                                             BLOCK_S=16, **PLAN), divisible=("stride_oh",))
    assert "ld.global.v4.b32" in reduce[16] and "ld.global.v4.b32" not in reduce[1]


@pytest.mark.parametrize("gqa", [False, True])
def test_prefill(gqa):
    pack = dict(GQA=True, BLOCK_G=4) if gqa else dict(GQA=False, BLOCK_G=1)
    _moves_rows_16_bytes_only_at_unit_16(_ptx(paged_prefill_kernel, dict(
        GROUP=4, HEAD_DIM=128, BLOCK_SIZE=16, BLOCK_M=128, BLOCK_D=128, BLOCK_N=64, IEEE=False, LONGEST_FIRST=False,
        k_desc=None, v_desc=None, TMA=False, WS=False, WINDOW=0, SOFTCAP=0.0, **pack, **NO_FP8), num_warps=8))


def test_unified_and_its_reduce():
    _moves_rows_16_bytes_only_at_unit_16(_ptx(unified_attention_kernel, dict(
        GROUP=4, HEAD_DIM=128, BLOCK_SIZE=16, BLOCK_Q=16, BLOCK_G=4, BLOCK_D=128, BLOCK_N=64, IEEE=False,
        WINDOW=0, SOFTCAP=0.0, **NO_FP8)))
    reduce = _ptx(reduce_tiles_kernel, dict(GROUP=4, HEAD_DIM=128, BLOCK_Q=16, BLOCK_G=4, BLOCK_D=128),
                  divisible=("stride_oh",))
    assert "st.global.v4.b32" in reduce[16] and "st.global.b16" in reduce[1] and "st.global.b16" not in reduce[16]
