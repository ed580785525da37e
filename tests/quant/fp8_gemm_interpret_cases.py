"""Cases for test_fp8_gemm_interpret.py (run with TRITON_INTERPRET=1): the Triton W8A8 GEMM
(layers/quant/triton_fp8_gemm.py) against fp8_ops.fp8_gemm's reference, the same fp8 values
dequantized into a float32 matmul. Under the interpreter the dot widens to float32 too, so the
two differ by accumulation order only: float32 round-off, far below one bf16 rounding."""
import os

import pytest
import torch

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("run through test_fp8_gemm_interpret.py (needs TRITON_INTERPRET=1 before importing triton)",
                allow_module_level=True)

from interpreter_fixes import apply as _fix_interpreter  # noqa: E402

_fix_interpreter()

from triton.runtime import interpreter  # noqa: E402

from pagedserve.layers.quant import fp8_ops  # noqa: E402
from pagedserve.layers.quant import triton_fp8_gemm as gemm  # noqa: E402
from pagedserve.layers.quant.fp8_gemm_config import KEYS, get_config  # noqa: E402
from pagedserve.layers.quant.triton_fp8_gemm import triton_fp8_gemm  # noqa: E402


def test_kernel_is_interpreted():
    assert isinstance(gemm.fp8_gemm_kernel, interpreter.InterpretedFunction)


def _reference(xq, xs, wq, ws):
    """fp8_ops.fp8_gemm's CPU path: the path FP8 linears run off CUDA."""
    return fp8_ops.fp8_gemm(xq, xs, wq, ws, torch.float32)


# Token counts that pick each block config (1, 16 | 17, 64 | 65 | 300), with M, N and K that end
# mid-block (N 80 = a 64 block + 16; K 200 = one 128 step + a masked 72).
@pytest.mark.parametrize("m", [1, 5, 17, 65, 300])
@pytest.mark.parametrize("per_tensor_weight", [False, True])
def test_triton_fp8_gemm_matches_dequantized_reference(m, per_tensor_weight):
    g = torch.Generator().manual_seed(m)
    n, k = 80, 200
    x = torch.randn(m, k, generator=g) * torch.logspace(-2, 2, m).unsqueeze(1)  # rows of very different size
    w = torch.randn(n, k, generator=g) * 0.05
    xq, xs = fp8_ops.quantize_per_token_torch(x)
    if per_tensor_weight:
        ws = (w.abs().amax() / fp8_ops.FP8_MAX).reshape(1)
        wq = fp8_ops.to_fp8(w, ws)
    else:
        wq, ws = fp8_ops.quantize_per_channel(w)
    ref = _reference(xq, xs, wq, ws)
    out32 = triton_fp8_gemm(xq, xs, wq, ws, torch.float32)
    torch.testing.assert_close(out32, ref, rtol=1e-5, atol=1e-5 * float(ref.abs().max()))
    out16 = triton_fp8_gemm(xq, xs, wq, ws, torch.bfloat16)
    assert out16.dtype == torch.bfloat16
    torch.testing.assert_close(out16.float(), ref, rtol=2 ** -7, atol=2 ** -7 * float(ref.abs().max()))


def test_static_activation_scale_and_empty_input():
    """A checkpoint's static input scale is one value; no rows give an empty output."""
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(7, 96, generator=g), torch.randn(48, 96, generator=g)
    xs = (x.abs().amax() / fp8_ops.FP8_MAX).reshape(1)
    xq = fp8_ops.to_fp8(x, xs)
    wq, ws = fp8_ops.quantize_per_channel(w)
    torch.testing.assert_close(triton_fp8_gemm(xq, xs, wq, ws, torch.float32), _reference(xq, xs, wq, ws),
                               rtol=1e-5, atol=1e-4)
    assert triton_fp8_gemm(xq[:0], xs, wq, ws).shape == (0, 48)


def _operands(m, n, k, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g) * torch.logspace(-2, 2, m).unsqueeze(1)
    xq, xs = fp8_ops.quantize_per_token_torch(x)
    wq, ws = fp8_ops.quantize_per_channel(torch.randn(n, k, generator=g) * 0.05)
    return xq, xs, wq, ws


# Split-K: K 200 in 32-deep steps is 7 steps; 2, 3 and 4 splits end mid-way (the last split
# shorter), 8 splits leave the eighth empty (it must add zeros, not garbage). Narrow BLOCK_N 16/32
# and row blocks taller than M (masked rows) as the decode configs have them.
@pytest.mark.parametrize("split,block_n,m", [(2, 32, 3), (3, 16, 1), (4, 32, 17), (8, 16, 2)])
def test_split_k_matches_dequantized_reference(split, block_n, m):
    n, k = 40, 200
    xq, xs, wq, ws = _operands(m, n, k, split)
    ref = _reference(xq, xs, wq, ws)
    cfg = dict(BLOCK_M=16, BLOCK_N=block_n, BLOCK_K=32, GROUP_M=1, SPLIT_K=split, num_warps=4, num_stages=3)
    out32 = triton_fp8_gemm(xq, xs, wq, ws, torch.float32, config=cfg)
    torch.testing.assert_close(out32, ref, rtol=1e-5, atol=1e-5 * float(ref.abs().max()))
    out16 = triton_fp8_gemm(xq, xs, wq, ws, torch.bfloat16, config=cfg)
    torch.testing.assert_close(out16.float(), ref, rtol=2 ** -7, atol=2 ** -7 * float(ref.abs().max()))


def test_split_k_with_one_activation_scale():
    """A static (per-tensor) activation scale through the reduce kernel: stride 0 there too."""
    xq, _, wq, ws = _operands(5, 24, 96, 1)
    xs = torch.tensor([0.03])
    cfg = dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=32, GROUP_M=1, SPLIT_K=3, num_warps=4, num_stages=3)
    torch.testing.assert_close(triton_fp8_gemm(xq, xs, wq, ws, torch.float32, config=cfg),
                               _reference(xq, xs, wq, ws), rtol=1e-5, atol=1e-4)


def test_default_configs_split_k_for_llama_decode_shapes():
    """The untuned choice at decode sizes splits K on the narrow-N shapes (o, down: 64 tiles) and
    keeps every config a valid launch: BLOCK_K a multiple of an fp8 dot's 32, >= 4 K steps a split."""
    for n, k in ((6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)):
        for m in (1, 2, 3, 16, 17, 64, 65, 256, 257, 8192):
            cfg = get_config(m, n, k, torch.device("cpu"))
            assert set(cfg) == set(KEYS)
            assert cfg["BLOCK_K"] % 32 == 0 and cfg["BLOCK_M"] >= 16 and cfg["BLOCK_N"] >= 16
            assert -(-k // cfg["BLOCK_K"]) // cfg["SPLIT_K"] >= 4
    assert get_config(1, 4096, 14336, torch.device("cpu"))["SPLIT_K"] > 1
    assert get_config(1, 4096, 4096, torch.device("cpu"))["SPLIT_K"] > 1
    assert get_config(1000, 4096, 4096, torch.device("cpu"))["SPLIT_K"] == 1
