"""The gated MLPs' activations on the merged gate/up projection: SwiGLU's, and GeGLU's (Gemma)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from pagedserve.layers.fused import fused_ops
from pagedserve.layers.quant.fp8_ops import Fp8Activation, quantize_activation


def silu_and_mul(gate_up: torch.Tensor, fp8_out: bool = False) -> torch.Tensor | Fp8Activation:
    """silu(gate) * up for gate_up = [..., 2 * I], gate first; HF's two roundings (silu, then product).
    fp8_out (the consumer is an FP8 linear): the result quantized per token, in the same kernel on CUDA."""
    ops = fused_ops(gate_up.device)
    if ops is not None:
        if fp8_out:
            return Fp8Activation(*ops.silu_and_mul_fp8(gate_up), gate_up.dtype)
        return ops.silu_and_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    y = F.silu(gate) * up
    return quantize_activation(y) if fp8_out else y


def gelu_tanh_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gelu(gate, tanh approximation) * up for gate_up = [..., 2 * I], gate first: Gemma's GeGLU
    (HF's gelu_pytorch_tanh), with HF's two roundings. Plain torch on every device."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up
