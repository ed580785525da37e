"""The FP8 KV cache: its dtype, and how K/V meet it.

An fp8 pool holds e4m3 values; real = stored * scale, with one float32 scale for K and one for V
per layer (Attention.k_scale / v_scale, shape [1], on the device). Per layer and not per block,
so a block means the same wherever it goes: swap, copy-on-write and prefix sharing move its
bytes and nothing else. Scales are 1.0 unless the checkpoint carries them (compressed-tensors
kv_cache_scheme: model.layers.N.self_attn.k_scale) or calculate_kv_scales sets them from a
calibration forward (amax * KV_SCALE_HEADROOM / 448, so values up to twice the calibration's
amax still fit before saturating).

Writes quantize (x / scale, saturated to +-448, rounded to nearest even); reads dequantize in
the kernels' registers: K is cast to the query's dtype and its scale folded into the score
scale, V is cast likewise and its scale applied once to the output.
"""
from __future__ import annotations

import torch

FP8_KV_DTYPE = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8_KV_DTYPE).max
KV_SCALE_HEADROOM = 2.0


def is_fp8(t_or_dtype) -> bool:
    dtype = t_or_dtype if isinstance(t_or_dtype, torch.dtype) else t_or_dtype.dtype
    return dtype == FP8_KV_DTYPE


def resolve_kv_cache_dtype(kv_cache_dtype: str, model_dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """"auto" -> the model dtype; "fp8" / "fp8_e4m3" -> float8_e4m3fn, where the device can."""
    if kv_cache_dtype == "auto":
        return model_dtype
    if kv_cache_dtype not in ("fp8", "fp8_e4m3"):
        raise ValueError(f"kv_cache_dtype must be auto, fp8 or fp8_e4m3, got {kv_cache_dtype!r}")
    device = torch.device(device)
    if device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 9):
        cap = ".".join(map(str, torch.cuda.get_device_capability(device)))
        raise ValueError(f"kv_cache_dtype fp8: {torch.cuda.get_device_name(device)} (compute capability {cap}) "
                         "cannot convert e4m3 in its kernels; it needs 8.9 or newer (Ada, Hopper, Blackwell)")
    return FP8_KV_DTYPE


def kv_cache_dtype_name(kv_cache_dtype: str, model_dtype: torch.dtype) -> str:
    """What the stats and /metrics call the pools' element type: fp8_e4m3, or the model dtype's name."""
    return "fp8_e4m3" if kv_cache_dtype in ("fp8", "fp8_e4m3") else str(model_dtype).removeprefix("torch.")


def quantize_kv(x: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    """x / scale as e4m3 (saturating); the reference write and the tests' oracle."""
    s = 1.0 if scale is None else scale.float()
    return (x.float() / s).clamp(-FP8_MAX, FP8_MAX).to(FP8_KV_DTYPE)


def dequantize_kv(x: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    """float32 values of a (possibly fp8) cache slice; a non-fp8 cache is only upcast."""
    if not is_fp8(x):
        return x.float()
    return x.float() * (1.0 if scale is None else scale.float())


def calibration_scale(amax: torch.Tensor) -> torch.Tensor:
    return (amax.float() * KV_SCALE_HEADROOM / FP8_MAX).clamp(min=1e-8).reshape(1)
