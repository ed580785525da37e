"""The one-launch rotary + K/V write (attention/triton_cache.rope_write_kv_kernel) compiles for the
H200 without one, with and without Qwen3's q/k norms, full and partial rotary, at the launch's
warps; its arithmetic is checked under the interpreter (layers/fused_interpret_cases.py)."""
import os

import pytest

if os.environ.get("TRITON_INTERPRET") == "1":
    pytest.skip("compiles for the GPU: not under the interpreter", allow_module_level=True)

from pagedserve.attention.triton_cache import rope_write_kv_kernel  # noqa: E402
from sm90_compile import compile_sm90  # noqa: E402

POINTERS = {name: "*bf16" for name in ("q_ptr", "k_ptr", "v_ptr", "qw_ptr", "kw_ptr", "cos_ptr", "sin_ptr",
                                        "k_cache_ptr", "v_cache_ptr")}
POINTERS.update(slot_ptr="*i64", eps="fp32")


@pytest.mark.parametrize("has_norm,rest", [(False, 0), (True, 0), (False, 64), (True, 64)])
def test_rope_write_kv_kernel_compiles_for_sm90(has_norm, rest):
    half = (128 - rest) // 2
    ptx = compile_sm90(rope_write_kv_kernel, dict(HEAD_DIM=128, HALF=half, REST=rest, BLOCK_HALF=half,
                                                  BLOCK_REST=max(rest, 1), BLOCK_D=128, HAS_NORM=has_norm,
                                                  HEADS=8, BLOCK_SIZE=16, k_scale_ptr=None, v_scale_ptr=None,
                                                  KV_FP8=False, KV_SCALE_PER_HEAD=False), POINTERS, num_warps=4)
    assert ptx.count("st.global") >= 3  # q/k in place, the K pool, the V pool
    assert ("rsqrt" in ptx) == has_norm


@pytest.mark.parametrize("per_head", [False, True])
def test_rope_write_kv_kernel_compiles_for_sm90_into_fp8_pools(per_head):
    pointers = dict(POINTERS, k_cache_ptr="*fp8e4nv", v_cache_ptr="*fp8e4nv", k_scale_ptr="*fp32", v_scale_ptr="*fp32")
    ptx = compile_sm90(rope_write_kv_kernel, dict(HEAD_DIM=128, HALF=64, REST=0, BLOCK_HALF=64, BLOCK_REST=1,
                                                  BLOCK_D=128, HAS_NORM=True, HEADS=8, BLOCK_SIZE=16, KV_FP8=True,
                                                  KV_SCALE_PER_HEAD=per_head), pointers, num_warps=4)
    assert "e4m3" in ptx  # the conversion to the pool's bytes


@pytest.mark.parametrize("has_norm", [False, True])
def test_the_rotary_alone_still_compiles_for_sm90(has_norm):
    """layers/triton_fused._qk_norm_rope_kernel shares norm_rope_heads, whose K-pool store it leaves off."""
    from pagedserve.layers.triton_fused import _qk_norm_rope_kernel
    ptx = compile_sm90(_qk_norm_rope_kernel, dict(HEAD_DIM=128, HALF=64, REST=0, BLOCK_HALF=64, BLOCK_REST=1,
                                                  HAS_NORM=has_norm, HEADS=8), POINTERS, num_warps=4)
    assert ("rsqrt" in ptx) == has_norm
