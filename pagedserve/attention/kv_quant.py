"""The FP8 KV cache: its dtype, and how K/V meet it.

An fp8 pool holds e4m3 values; real = stored * scale[head], with float32 scales for K and for V
per layer (Attention.k_scale / v_scale, on the device): shape [1] (per tensor: every head shares
it) or [num_kv_heads] (per KV head, this rank's heads under tensor parallelism; compressed-tensors'
kv_cache_scheme strategy "attn_head"). K and V of one layer always have the same shape. Per layer
and head, never per block, so a block means the same wherever it goes: swap, copy-on-write and
prefix sharing move its bytes and nothing else. Scales are 1.0 unless the checkpoint carries them
(compressed-tensors kv_cache_scheme: model.layers.N.self_attn.k_scale, [1] or [num_kv_heads]) or
calculate_kv_scales sets them from a calibration forward (amax * KV_SCALE_HEADROOM / 448 of the
layer's K/V, or of each head's with kv_cache_scale_strategy "attn_head", so values up to twice
the calibration's amax still fit before saturating).

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


def _over_heads(scale: torch.Tensor | None):
    """A [1] or [num_kv_heads] scale shaped [n, 1] to broadcast over [..., num_kv_heads, head_dim]."""
    return 1.0 if scale is None else scale.float().reshape(-1, 1)


def quantize_kv(x: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    """x ([..., num_kv_heads, head_dim]) / scale[head] as e4m3 (saturating); the reference write and
    the tests' oracle."""
    return (x.float() / _over_heads(scale)).clamp(-FP8_MAX, FP8_MAX).to(FP8_KV_DTYPE)


def dequantize_kv(x: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    """float32 values of a (possibly fp8) cache slice [..., num_kv_heads, head_dim]; a non-fp8 cache
    is only upcast."""
    if not is_fp8(x):
        return x.float()
    return x.float() * _over_heads(scale)


def calibration_scale(amax: torch.Tensor) -> torch.Tensor:
    """The scale for an amax: [1] from a scalar, [num_kv_heads] from per-head amaxes."""
    return (amax.float() * KV_SCALE_HEADROOM / FP8_MAX).clamp(min=1e-8).reshape(-1)
