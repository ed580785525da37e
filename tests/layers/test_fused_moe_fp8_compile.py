"""The FP8 grouped GEMM compiles for the GPUs FP8 runs on, without one: Triton compiles the kernel
ahead of time for sm_90 (H100/H200) and sm_89 (Ada) with its bundled ptxas, and the PTX multiplies
8-bit operands: wgmma e4m3 for blocks of 64+ rows on Hopper; for 16-row (decode) blocks on Hopper,
Triton's mma.sync path widens e4m3 to f16 in registers (exact) for an f16 mma with float32
accumulation, the weights still read as one byte each; Ada has mma.sync e4m3 itself. The
interpreter tests check the arithmetic; this checks the GPU build (an fp8 dot needs both operands
e4m3 and K in steps of 32)."""
import os
import re

import pytest
import triton

if os.environ.get("TRITON_INTERPRET") == "1":
    pytest.skip("compiles for the GPU: not under the interpreter", allow_module_level=True)

from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from pagedserve.layers.fused_moe.triton_moe import _moe_gemm_kernel  # noqa: E402

POINTERS = {"a_ptr": "*fp8e4nv", "b_ptr": "*fp8e4nv", "c_ptr": "*bf16", "weights_ptr": "*bf16",
            "sorted_ids_ptr": "*i32", "block_expert_ptr": "*i32", "num_padded_ptr": "*i32",
            "a_scale_ptr": "*fp32", "b_scale_ptr": "*fp32"}


def _ptx(target, gated: bool, block_m: int, block_n: int, block_k: int) -> str:
    fn = _moe_gemm_kernel
    const = dict(A_ROW_DIV=8 if gated else 1, GATED=gated, MUL_WEIGHT=not gated, IEEE=False, FP8=True,
                 BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, GROUP_M=1)
    names = fn.arg_names
    sig = {n: POINTERS.get(n, "constexpr" if n in const else "i32") for n in names}
    src = ASTSource(fn=fn, signature=sig, constexprs={(names.index(k),): v for k, v in const.items()})
    return triton.compile(src, target=target, options={"num_warps": 4, "num_stages": 3}).asm["ptx"]


@pytest.mark.parametrize("arch,gated,block_m,instr", [
    (90, False, 64, r"wgmma\.mma_async\S*\.f32\.e4m3\.e4m3"),
    (90, True, 16, r"mma\.sync\S*\.f32\.f16\.f16\.f32"),  # after cvt.rn.f16x2.e4m3x2
    (89, True, 16, r"mma\.sync\S*\.f32\.e4m3\.e4m3\.f32")])
def test_fp8_grouped_gemm_compiles_to_8_bit_operand_tensor_core_code(arch, gated, block_m, instr):
    try:
        ptx = _ptx(GPUTarget("cuda", arch, 32), gated, block_m, 64, 64)
    except RuntimeError as e:  # no ptxas in this Triton build: nothing to check offline
        if "ptxas" in str(e):
            pytest.skip(str(e))
        raise
    mmas = re.findall(r"\b(?:mma\.sync|wgmma\.mma_async)\S*", ptx)
    assert mmas and all(re.fullmatch(instr, m) for m in mmas), sorted(set(mmas))
    if ".f16.f16" in instr:  # the operands arrive as e4m3 and are widened in registers
        assert "cvt.rn.f16x2.e4m3x2" in ptx
