"""Rotary position embeddings (NeoX / HF "rotate_half" layout), default, linear and llama3 scaling.

cos/sin are computed from positions on the fly in float32, once per forward at the model
level, exactly as HF does (positions * inv_freq), so there is no max-position cache to size. On CUDA, rotate_qk runs q and k (and Qwen3's
per-head q/k RMSNorm before it) through one Triton kernel (triton_fused.qk_norm_rotary_).
"""
from __future__ import annotations

import math

import torch
from torch import nn

from pagedserve.layers.fused import fused_ops


def rope_parameters(config) -> dict:
    """rope params from an HF config: transformers 5 `rope_parameters`, or 4.x rope_scaling + rope_theta."""
    params = getattr(config, "rope_parameters", None)
    if params:
        params = dict(params)
        # Some configs hold one dict per layer type; all our families use a single one.
        if "rope_type" not in params and "rope_theta" not in params and len(params) and \
                all(isinstance(v, dict) for v in params.values()):
            params = dict(next(iter(params.values())))
    else:
        params = dict(getattr(config, "rope_scaling", None) or {})
    if "rope_theta" not in params:
        params["rope_theta"] = getattr(config, "rope_theta", 10000.0)
    params.setdefault("rope_type", params.get("type", "default"))
    return params


def _llama3_inv_freq(inv_freq: torch.Tensor, p: dict) -> torch.Tensor:
    factor, low, high = p["factor"], p["low_freq_factor"], p["high_freq_factor"]
    old_ctx = p["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_ctx / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)


SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, params: dict, partial_rotary_factor: float = 1.0):
        super().__init__()
        rope_type = params.get("rope_type", "default")
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(f"rope_type {rope_type!r} is not supported; supported: {SUPPORTED_ROPE_TYPES}")
        self.rotary_dim = int(head_dim * partial_rotary_factor)
        base = float(params["rope_theta"])
        inv_freq = 1.0 / (base ** (torch.arange(0, self.rotary_dim, 2, dtype=torch.int64).float().cpu()
                                   / self.rotary_dim))
        if rope_type == "linear":
            inv_freq = inv_freq / params["factor"]
        elif rope_type == "llama3":
            inv_freq = _llama3_inv_freq(inv_freq, params)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin of shape [T, 1, rotary_dim] (broadcast over heads), in `dtype` as HF casts them."""
        freqs = positions.float()[:, None] * self.inv_freq.float()[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype)[:, None, :], emb.sin().to(dtype)[:, None, :]


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, heads, head_dim]; rotates the first rotary_dim features, passes the rest through."""
    rd = cos.shape[-1]
    rot, rest = x[..., :rd], x[..., rd:]
    x1, x2 = rot[..., : rd // 2], rot[..., rd // 2:]
    rotated = rot * cos + torch.cat((-x2, x1), dim=-1) * sin
    return rotated if rest.shape[-1] == 0 else torch.cat((rotated, rest), dim=-1)


def rotate_qk(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, q_norm=None,
              k_norm=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary on q [T, Hq, D] and k [T, Hk, D], after the optional per-head RMSNorms (Qwen3).

    The fused path works in place: q and k must be views of this step's own projection output."""
    ops = fused_ops(q.device)
    if ops is not None and (q_norm is None or q_norm.weight.dtype == q.dtype == k.dtype):
        if q_norm is None:
            return ops.qk_norm_rotary_(q, k, cos, sin)
        return ops.qk_norm_rotary_(q, k, cos, sin, q_norm.weight, k_norm.weight, q_norm.eps)
    if q_norm is not None:
        q, k = q_norm(q), k_norm(k)
    return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
