"""The prefill and unified kernels compile for the H200 without one (Triton's bundled ptxas, as
test_decode_compile.py), with and without a sliding window and Gemma 2's soft cap: the interpreter
(window_interpret_cases.py) checks their arithmetic, this the compiler's rules. And Gemma's 256-wide
heads: every attention kernel's default launch fits the H200's shared memory at head_dim 256."""
import os

import pytest

if os.environ.get("TRITON_INTERPRET") == "1":
    pytest.skip("compiles for the GPU: not under the interpreter", allow_module_level=True)

import torch  # noqa: E402

from pagedserve.attention import decode_plan  # noqa: E402
from pagedserve.attention.triton_cache import rope_write_kv_kernel  # noqa: E402
from pagedserve.attention.triton_decode import paged_decode_kernel  # noqa: E402
from pagedserve.attention.triton_prefill import PREFILL_DEFAULT, paged_prefill_kernel  # noqa: E402
from pagedserve.attention.triton_unified import UNIFIED_DEFAULT, unified_attention_kernel  # noqa: E402
from sm90_compile import SM90_MAX_SHARED, compile_sm90, compile_sm90_kernel  # noqa: E402

POINTERS = {"q_ptr": "*bf16", "k_cache_ptr": "*bf16", "v_cache_ptr": "*bf16", "out_ptr": "*bf16",
            "mid_o_ptr": "*fp32", "mid_lse_ptr": "*fp32", "items_ptr": "*i32", "query_start_loc_ptr": "*i32",
            "seq_lens_ptr": "*i32", "block_tables_ptr": "*i32", "qk_scale": "fp32", "order_ptr": "*i64",
            "full_lens_ptr": "*i32", "k_ptr": "*bf16", "v_ptr": "*bf16", "qw_ptr": "*bf16", "kw_ptr": "*bf16",
            "cos_ptr": "*bf16", "sin_ptr": "*bf16", "slot_ptr": "*i64", "eps": "fp32"}
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


def test_gemma_head_dim_256_fits_shared_memory():
    """Gemma 2 and 3's heads are 256 wide (gemma-3-1b: 4 query heads on 1 KV head, gemma-2-9b: 2
    a KV head): each kernel at its default launch (head_dim > 128 keeps the prefill's small tiles)."""
    launch = decode_plan.decode_launch_for(torch.bfloat16)
    for group in (2, 4):
        decode = compile_sm90_kernel(paged_decode_kernel, dict(
            GROUP=group, HEAD_DIM=256, BLOCK_SIZE=16, BLOCK_G=16, BLOCK_D=256, BLOCK_N=launch.block_n,
            SPLIT_TOKENS=decode_plan.SLOTS, IEEE=False, HEADS_FASTEST=True, F16_DOT=False, SHARE_PROGRAMS=792,
            MIN_CHAIN_TILES=2, WINDOW=512, SOFTCAP=50.0, **NO_FP8), POINTERS, launch.num_warps, launch.num_stages)
        prefill = compile_sm90_kernel(paged_prefill_kernel, dict(
            GROUP=group, HEAD_DIM=256, BLOCK_SIZE=16, BLOCK_M=PREFILL_DEFAULT.block_m, BLOCK_D=256,
            BLOCK_N=PREFILL_DEFAULT.block_n, IEEE=False, LONGEST_FIRST=False, k_desc=None, v_desc=None, TMA=False,
            WS=False, WINDOW=512, SOFTCAP=0.0, GQA=False, BLOCK_G=1, **NO_FP8), POINTERS,
            PREFILL_DEFAULT.num_warps, PREFILL_DEFAULT.num_stages)
        unified = compile_sm90_kernel(unified_attention_kernel, dict(
            GROUP=group, HEAD_DIM=256, BLOCK_SIZE=16, BLOCK_Q=UNIFIED_DEFAULT.block_m // group, BLOCK_G=group,
            BLOCK_D=256, BLOCK_N=UNIFIED_DEFAULT.block_n, IEEE=False, WINDOW=512, SOFTCAP=0.0, **NO_FP8), POINTERS,
            UNIFIED_DEFAULT.num_warps, UNIFIED_DEFAULT.num_stages)
        for kernel in (decode, prefill, unified):
            assert 0 < kernel.metadata.shared <= SM90_MAX_SHARED
    rope = compile_sm90_kernel(rope_write_kv_kernel, dict(
        HEAD_DIM=256, HALF=128, REST=0, BLOCK_HALF=128, BLOCK_REST=1, BLOCK_D=256, HAS_NORM=True, HEADS=8,
        BLOCK_SIZE=16, k_scale_ptr=None, v_scale_ptr=None, KV_FP8=False, KV_SCALE_PER_HEAD=False), POINTERS)
    assert rope.metadata.shared <= SM90_MAX_SHARED
