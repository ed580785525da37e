"""Normalisation layers: torch's functionals (F.rms_norm, F.layer_norm) on CPU, and on CUDA
RMSNorm through the Triton kernels of triton_fused (with the residual add fused in)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedserve.layers.fused import fused_ops
from pagedserve.layers.weights import default_weight_loader


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.dim, self.eps = dim, eps
        self.weight = nn.Parameter(torch.ones(dim))
        self.weight.weight_loader = default_weight_loader

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """norm(x); or, given residual, (norm(s), s) with s = x + residual in x.dtype (the
        pre-norm block's residual add, fused into the norm on CUDA)."""
        ops = fused_ops(x.device)
        if ops is not None and x.dtype == self.weight.dtype:
            if residual is None:
                return ops.rms_norm(x, self.weight, self.eps)
            return ops.fused_add_rms_norm(x, residual, self.weight, self.eps)
        if residual is None:
            return self._norm(x)
        s = x + residual
        return self._norm(s), s

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        # HF normalises in float32 and casts back before the weight multiply; so do we.
        return F.rms_norm(x.float(), (self.dim,), eps=self.eps).to(x.dtype) * self.weight


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
