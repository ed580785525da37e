"""Rotary position embeddings (NeoX / HF "rotate_half" layout), default, linear, dynamic NTK, llama3, YaRN and
LongRoPE scaling.

cos/sin are computed from positions on the fly in float32, once per forward at the model
level, exactly as HF does (positions * inv_freq), so there is no max-position cache to size. On CUDA, rotate_qk runs q and k (and Qwen3's
per-head q/k RMSNorm before it) through one Triton kernel (triton_fused.qk_norm_rotary_). A layer
hands its Rope to the attention, which rotates where it stores K/V: on CUDA the same kernel then
writes k and v into the pools too (Attention.rotate_and_store).
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import torch
from torch import nn

from pagedserve.layers.fused import fused_ops

logger = logging.getLogger(__name__)


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


def _yarn(dim: int, base: float, p: dict) -> tuple[torch.Tensor, float]:
    """YaRN (Peng et al., 2023), as HF computes it: (inv_freq, attention factor).

    Frequency i keeps its unscaled value where a wavelength fits many times into the original
    context (fast rotations, beta_fast), is divided by `factor` where it fits less than beta_slow
    times, with a linear ramp between; cos and sin are then multiplied by the attention factor
    (0.1 ln(factor) + 1, or mscale / mscale_all_dim's ratio, or given), which HF folds into them."""
    factor, old_ctx = p["factor"], p["original_max_position_embeddings"]
    attention = p.get("attention_factor")
    if attention is None:
        def mscale(m: float = 1.0) -> float:
            return 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0
        m, m_all = p.get("mscale"), p.get("mscale_all_dim")
        attention = float(mscale(m) / mscale(m_all)) if m and m_all else mscale()
    beta_fast, beta_slow = p.get("beta_fast") or 32, p.get("beta_slow") or 1

    def dim_of(rotations: float) -> float:  # the dimension whose wavelength fits `rotations` times
        return dim * math.log(old_ctx / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = dim_of(beta_fast), dim_of(beta_slow)
    if p.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # HF's guard against a zero-width ramp
    # On the CPU, as HF computes them: the model is built under its device, and a GPU's pow may
    # differ from the CPU's by an ulp, ~1e-2 rad at 128k positions.
    ramp = ((torch.arange(dim // 2, dtype=torch.float32, device="cpu") - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # 1: the unscaled frequency, 0: divided by factor
    pos_freqs = base ** (torch.arange(0, dim, 2, device="cpu").float() / dim)
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - keep) + (1.0 / pos_freqs) * keep
    return inv_freq, attention


def _longrope(dim: int, base: float, p: dict, max_positions: int) -> tuple[torch.Tensor, float]:
    """LongRoPE (Phi-3, Phi-3.5, Phi-4-mini), as HF computes it: (inv_freq, attention factor).

    Each frequency is divided by its own factor, from `short_factor` or `long_factor`; cos and sin
    are multiplied by sqrt(1 + ln(factor) / ln(original length)) unless an attention_factor is given.
    HF switches to the long factors for a whole forward pass once the sequence passes the original
    length, and re-prefills its cache at the switch; a paged cache cannot re-rotate the keys it
    holds, so one set serves the engine's every position, chosen as vLLM chooses it: the long
    factors when max_positions (the engine's max_model_len) passes the original length."""
    old_ctx = p["original_max_position_embeddings"]
    factors = p["long_factor"] if max_positions > old_ctx else p["short_factor"]
    if max_positions > old_ctx:
        logger.info("LongRoPE: max_model_len %d is past the %d trained positions, so every position takes the "
                    "long factors, short prompts too (HF switches per pass); --max-model-len %d keeps the short "
                    "ones", max_positions, old_ctx, old_ctx)
    if len(factors) != dim // 2:
        raise ValueError(f"rope_parameters: longrope needs {dim // 2} factors (rotary dim {dim} / 2), "
                         f"got {len(factors)}")
    attention = p.get("attention_factor")
    if attention is None:
        factor = p["factor"]
        attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(old_ctx))
    ext = torch.tensor(factors, dtype=torch.float32, device="cpu")
    inv_freq = 1.0 / (ext * base ** (torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim))
    return inv_freq, float(attention)


def _dynamic_ntk_base(base: float, dim: int, p: dict) -> float:
    """Dynamic NTK scaling as vLLM serves it: one base for every position, HF's dynamic base at the
    longest length the scaling reaches (original x factor). HF recomputes the base from each
    pass's length (unscaled within the original), which no KV cache of earlier positions can follow."""
    old, factor = p["original_max_position_embeddings"], p["factor"]
    longest = int(old * factor)
    return base * ((factor * longest / old) - (factor - 1)) ** (dim / (dim - 2))


SUPPORTED_ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn", "longrope")


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, params: dict, partial_rotary_factor: float = 1.0,
                 max_positions: int | None = None):
        """max_positions: the longest sequence the engine runs (its max_model_len), which picks
        LongRoPE's factors; other kinds ignore it."""
        super().__init__()
        rope_type = params.get("rope_type", "default")
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(f"rope_type {rope_type!r} is not supported; supported: {SUPPORTED_ROPE_TYPES}")
        self.rotary_dim = int(head_dim * partial_rotary_factor)
        base = float(params["rope_theta"])
        if rope_type == "dynamic":
            base = _dynamic_ntk_base(base, self.rotary_dim, params)
        inv_freq = 1.0 / (base ** (torch.arange(0, self.rotary_dim, 2, dtype=torch.int64, device="cpu").float()
                                   / self.rotary_dim))
        self.attention_scaling = 1.0  # YaRN's and LongRoPE's factor on cos and sin (so on q.k), as HF applies it
        if rope_type == "linear":
            inv_freq = inv_freq / params["factor"]
        elif rope_type == "llama3":
            inv_freq = _llama3_inv_freq(inv_freq, params)
        elif rope_type == "yarn":
            inv_freq, self.attention_scaling = _yarn(self.rotary_dim, base, params)
        elif rope_type == "longrope":
            if max_positions is None:
                raise ValueError("longrope RoPE needs max_positions (the engine's max_model_len) to pick its factors")
            inv_freq, self.attention_scaling = _longrope(self.rotary_dim, base, params, max_positions)
        # LongRoPE's (base, params, max_positions): what fit_max_positions needs to pick its factors again.
        self._longrope = (base, params, max_positions) if rope_type == "longrope" else None
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def fit_max_positions(self, max_positions: int) -> None:
        """The engine's max_model_len once fitted to the KV cache (max_model_len auto: the model is
        built for its own limit, the length cut after the cache is sized): LongRoPE's factors follow
        it, so a fitted length within the trained positions takes the short ones, as that length
        given outright does. In place (the buffer keeps its shape and device); other kinds ignore it."""
        if self._longrope is None:
            return
        base, params, built_for = self._longrope
        old_ctx = params["original_max_position_embeddings"]
        if (max_positions > old_ctx) != (built_for > old_ctx):  # the other factor set
            inv_freq, _ = _longrope(self.rotary_dim, base, params, max_positions)  # same attention factor
            self.inv_freq.copy_(inv_freq)
        self._longrope = (base, params, max_positions)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin of shape [T, 1, rotary_dim] (broadcast over heads), in `dtype` as HF casts them
        (scaled in float32 first, where YaRN and LongRoPE scale them)."""
        freqs = positions.float()[:, None] * self.inv_freq.float()[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos(), emb.sin()
        if self.attention_scaling != 1.0:
            cos, sin = cos * self.attention_scaling, sin * self.attention_scaling
        return cos.to(dtype)[:, None, :], sin.to(dtype)[:, None, :]


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


@dataclass(frozen=True)
class Rope:
    """One layer's rotary for one step, applied by the attention where it stores K/V: cos/sin
    [T, 1, rotary_dim] and Qwen3's per-head q/k RMSNorms (None elsewhere)."""
    cos: torch.Tensor
    sin: torch.Tensor
    q_norm: nn.Module | None = None
    k_norm: nn.Module | None = None

    def apply(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return rotate_qk(q, k, self.cos, self.sin, self.q_norm, self.k_norm)

    def norm_weights(self) -> dict:
        """rope_write_kv's norm arguments (none without q/k norms)."""
        if self.q_norm is None:
            return {}
        return dict(q_weight=self.q_norm.weight, k_weight=self.k_norm.weight, eps=self.q_norm.eps)
