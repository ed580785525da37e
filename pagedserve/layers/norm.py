"""Normalisation layers: torch's functionals (F.rms_norm, F.layer_norm) on CPU, and on CUDA
RMSNorm through the Triton kernels of triton_fused (with the residual add fused in, and, before an
FP8 linear, the per-token FP8 quantization of its output)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedserve.layers.fused import fused_ops
from pagedserve.layers.quant.fp8_ops import Fp8Activation, quantize_activation
from pagedserve.layers.weights import default_weight_loader


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.dim, self.eps = dim, eps
        self.weight = nn.Parameter(torch.ones(dim))
        self.weight.weight_loader = default_weight_loader
        # Set once at load time (layers/quant/fusion.py) where the norm feeds an FP8 linear: the
        # norm's output then comes quantized per token, an fp8_ops.Fp8Activation.
        self.fp8_out = False

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """norm(x); or, given residual, (norm(s), s) with s = x + residual in x.dtype (the
        pre-norm block's residual add, fused into the norm on CUDA). With fp8_out, norm(...) is
        an Fp8Activation; the residual stream s stays in x.dtype."""
        ops = fused_ops(x.device)
        if ops is not None and x.dtype == self.weight.dtype:
            if self.fp8_out:
                if residual is None:
                    return Fp8Activation(*ops.rms_norm_fp8(x, self.weight, self.eps), x.dtype)
                q, scale, s = ops.fused_add_rms_norm_fp8(x, residual, self.weight, self.eps)
                return Fp8Activation(q, scale, x.dtype), s
            if residual is None:
                return ops.rms_norm(x, self.weight, self.eps)
            return ops.fused_add_rms_norm(x, residual, self.weight, self.eps)
        if residual is None:
            return self._out(self._norm(x))
        s = x + residual
        return self._out(self._norm(s)), s

    def _out(self, y: torch.Tensor) -> torch.Tensor | Fp8Activation:
        return quantize_activation(y) if self.fp8_out else y

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        # HF normalises in float32 and casts back before the weight multiply; so do we.
        return F.rms_norm(x.float(), (self.dim,), eps=self.eps).to(x.dtype) * self.weight


class Fp32WeightRMSNorm(RMSNorm):
    """RMSNorm whose weight multiplies in float32, rounded once after (Gemma's and OLMo 2's HF norms;
    Llama's rounds the normalised x first). On CUDA the same fused kernels as RMSNorm."""

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        return (F.rms_norm(x.float(), (self.dim,), eps=self.eps) * self.weight.float()).to(x.dtype)


class LayerNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5, elementwise_affine: bool = True):
        super().__init__()
        self.dim, self.eps = dim, eps
        if elementwise_affine:
            self.weight = nn.Parameter(torch.ones(dim))
            self.bias = nn.Parameter(torch.zeros(dim))
            self.weight.weight_loader = self.bias.weight_loader = default_weight_loader
        else:
            self.weight = self.bias = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, (self.dim,), self.weight, self.bias, self.eps)
