"""Normalisation layers on torch's fused functionals (F.rms_norm, F.layer_norm)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedserve.layers.weights import default_weight_loader


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.dim, self.eps = dim, eps
        self.weight = nn.Parameter(torch.ones(dim))
        self.weight.weight_loader = default_weight_loader

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # HF normalises in float32 and casts back before the weight multiply; so do we.
        out = F.rms_norm(x.float(), (self.dim,), eps=self.eps).to(x.dtype)
        return out * self.weight


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
