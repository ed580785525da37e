"""Dynamic per-token FP8 quantization in one Triton kernel (the CUDA path of
fp8_ops.quantize_per_token): one program per row reads it twice (amax, then scale and cast), where
the torch path launches five kernels (abs, amax, divide, clamp, cast) before every FP8 GEMM.
The torch path's arithmetic: scale = max(amax / 448, MIN_SCALE) in float32,
q = e4m3(clamp(x / scale, +-448)), rounded to nearest even. On the H200 the scales differ from torch's in
their last bits (within 1e-5, relative): not bit-equal.
"""
import torch
import triton
import triton.language as tl

from pagedserve.layers.quant.fp8_format import FP8_DTYPE, FP8_MAX, MIN_SCALE
from pagedserve.host_math import next_power_of_2


@triton.jit
def per_token_fp8_kernel(x_ptr, q_ptr, scale_ptr, stride_x, stride_q, N,
                         FP8_MAX: tl.constexpr, MIN_SCALE: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    amax = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, N, BLOCK):
        mask = start + offs < N
        x = tl.load(x_ptr + row * stride_x + start + offs, mask=mask, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(x))
    scale = tl.maximum(tl.math.div_rn(tl.max(amax, 0), FP8_MAX), MIN_SCALE)
    tl.store(scale_ptr + row, scale)
    for start in range(0, N, BLOCK):
        mask = start + offs < N
        x = tl.load(x_ptr + row * stride_x + start + offs, mask=mask, other=0.0).to(tl.float32)
        # div_rn: IEEE division like torch's (Triton's "/" is approximate on the GPU).
        q = tl.clamp(tl.math.div_rn(x, scale), -FP8_MAX, FP8_MAX).to(q_ptr.dtype.element_ty,
                                                                     fp_downcast_rounding="rtne")
        tl.store(q_ptr + row * stride_q + start + offs, q, mask=mask)


def quantize_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (row-contiguous) -> (fp8 [M, K], float32 scale [M, 1])."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    M, K = x.shape
    q = torch.empty(M, K, dtype=FP8_DTYPE, device=x.device)
    scale = torch.empty(M, 1, dtype=torch.float32, device=x.device)
    if M:
        per_token_fp8_kernel[(M,)](x, q, scale, x.stride(0), q.stride(0), K, FP8_MAX=FP8_MAX, MIN_SCALE=MIN_SCALE,
                                   BLOCK=min(4096, next_power_of_2(K)), num_warps=4)
    return q, scale
