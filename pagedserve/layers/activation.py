"""SwiGLU's activation on the merged gate/up projection."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from pagedserve.layers.fused import fused_ops


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for gate_up = [..., 2 * I], gate first; HF's two roundings (silu, then product)."""
    ops = fused_ops(gate_up.device)
    if ops is not None:
        return ops.silu_and_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up
