"""FP8 (e4m3) quantize ops and the W8A8 GEMM.

Scales are float32 and multiply: real = fp8 * scale. Weights carry one scale per output channel
([N]); activations one per token ([M, 1], dynamic: amax / 448 of the row) or one for the tensor
(static, from the checkpoint). The GEMM on CUDA is torch._scaled_mm (cuBLASLt's FP8 path with
row-wise scales, sm89+) or our Triton kernel (triton_fp8_gemm.py), as PAGEDSERVE_FP8_GEMM says
(GEMM_MODES; DEFAULT_GEMM when unset); elsewhere the same arithmetic dequantized: the fp8 values
are exact in float32, so the CPU path differs from the GPU only by accumulation order.

Fp8Activation is an activation the op before the linear (RMSNorm, SiLU-and-mul) already quantized
per token, in its own kernel on CUDA (layers/triton_fused.py): the FP8 linear takes it as its input
instead of quantizing again (layers/quant/fusion.py decides where, once at load time).
"""
from __future__ import annotations

import os
from typing import NamedTuple

import torch

from pagedserve.layers.quant.fp8_format import FP8_DTYPE, FP8_MAX, MIN_SCALE  # noqa: F401 (re-exported)

QUANT_ENV = "PAGEDSERVE_FP8_QUANT"


def to_fp8(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x / scale, saturated to +-448 and rounded to e4m3 (nearest even)."""
    return (x.float() / scale).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def quantize_per_channel(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] -> (fp8 [N, K], float32 scale [N]): each output row scaled to its own amax."""
    scale = (w.abs().amax(dim=1).float() / FP8_MAX).clamp_(min=MIN_SCALE)
    return to_fp8(w, scale[:, None]), scale


def quantize_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (fp8 [M, K], float32 scale [M, 1]): dynamic, one scale per row. On CUDA one
    Triton kernel (triton_fp8.py; PAGEDSERVE_FP8_QUANT=torch keeps these torch ops, for A/B)."""
    if x.is_cuda and os.environ.get(QUANT_ENV, "triton") != "torch":
        from pagedserve.layers.quant import triton_fp8
        return triton_fp8.quantize_per_token(x)
    return quantize_per_token_torch(x)


def quantize_per_token_torch(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """quantize_per_token in torch ops: the CPU path and the kernel's reference."""
    scale = (x.abs().amax(dim=-1, keepdim=True).float() / FP8_MAX).clamp_(min=MIN_SCALE)
    return to_fp8(x, scale), scale


class Fp8Activation(NamedTuple):
    """q: fp8 [..., K]; scale: float32 [M, 1], one per row of q.reshape(-1, K), as
    quantize_per_token gives them; dtype: what the activation was before (the GEMM's output dtype)."""
    q: torch.Tensor
    scale: torch.Tensor
    dtype: torch.dtype


def quantize_activation(x: torch.Tensor) -> Fp8Activation:
    """x [..., K] quantized per token (quantize_per_token): the unfused path of an op whose
    consumer is an FP8 linear, and the reference of the fused kernels."""
    q, scale = quantize_per_token(x.reshape(-1, x.shape[-1]))
    return Fp8Activation(q.view(x.shape), scale, x.dtype)


def quantize_static(x: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] with one given scale (a checkpoint's input_scale) -> (fp8, scale as [M, 1])."""
    return to_fp8(x, scale), scale.reshape(1, 1).expand(x.shape[0], 1).contiguous()


def dequantize(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """float32 q * scale (scale broadcast: [N, 1] per row, a scalar per tensor)."""
    return q.float() * scale


def scaled_mm_supported(device: torch.device) -> bool:
    """torch._scaled_mm's FP8 path needs compute capability 8.9 (Ada, Hopper) or newer."""
    device = torch.device(device)
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


GEMM_ENV = "PAGEDSERVE_FP8_GEMM"
# cublas: torch._scaled_mm always; triton: our kernel always; auto: Triton at the token counts where
# it beats cuBLASLt (fp8_gemm_config.triton_wins: the tuned table's timings, else M <= AUTO_MAX_M).
GEMM_MODES = ("cublas", "triton", "auto")
# `auto` since the H200 lease of 2026-12-02 (fp8.json): with the tuned tables and the f16 decode
# launch, Llama-3.1-8B FP8 served sharegpt-like at 10 req/s at TPOT p50 5.1 ms against 5.6 ms
# with cublas and the bf16 launch, same lease.
DEFAULT_GEMM = "auto"
_GEMM_MODE: str | None = None


def gemm_mode() -> str:
    """PAGEDSERVE_FP8_GEMM (empty or unset: DEFAULT_GEMM), read once per process."""
    global _GEMM_MODE
    if _GEMM_MODE is None:
        mode = os.environ.get(GEMM_ENV, "").strip().lower() or DEFAULT_GEMM
        if mode not in GEMM_MODES:
            raise ValueError(f"{GEMM_ENV} must be one of {', '.join(GEMM_MODES)}, got {mode!r}")
        _GEMM_MODE = mode
    return _GEMM_MODE


def uses_triton(m: int, n: int, k: int, device: torch.device) -> bool:
    """Whether a CUDA GEMM of m tokens against an [n, k] weight runs our Triton kernel."""
    mode = gemm_mode()
    if mode == "auto":
        from pagedserve.layers.quant.fp8_gemm_config import triton_wins
        return triton_wins(m, n, k, device)
    return mode == "triton"


def fp8_gemm(xq: torch.Tensor, x_scale: torch.Tensor, wq: torch.Tensor, w_scale: torch.Tensor,
             out_dtype: torch.dtype, bias: torch.Tensor | None = None) -> torch.Tensor:
    """(xq * x_scale) @ (wq * w_scale[:, None]).T (+ bias) in out_dtype.

    xq [M, K] fp8, x_scale [M, 1] f32, wq [N, K] fp8, w_scale [N] f32.
    """
    if xq.is_cuda and uses_triton(xq.shape[0], wq.shape[0], wq.shape[1], xq.device):
        from pagedserve.layers.quant.triton_fp8_gemm import triton_fp8_gemm
        y = triton_fp8_gemm(xq, x_scale, wq, w_scale, out_dtype)
    elif xq.is_cuda:
        # Row-wise scaled FP8 GEMMs produce bfloat16; wq.t() is the column-major operand cuBLASLt wants.
        y = torch._scaled_mm(xq, wq.t(), scale_a=x_scale, scale_b=w_scale.view(1, -1), out_dtype=torch.bfloat16)
        y = y if out_dtype == torch.bfloat16 else y.to(out_dtype)
    else:
        y = (dequantize(xq, x_scale) @ dequantize(wq, w_scale[:, None]).t()).to(out_dtype)
    return y if bias is None else y + bias
