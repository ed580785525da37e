"""Where an FP8 linear's activation quantization runs inside the op before it: decided once, at
load time, never per step.

A Llama-family decoder layer (models/llama.py) has three such pairs: input_layernorm -> qkv_proj,
post_attention_layernorm -> gate_up_proj, SiLU-and-mul -> down_proj. Where the linear's method
takes_fp8_activation (FP8 W8A8 with dynamic per-token activation scales), the op before it is told
to return an fp8_ops.Fp8Activation, which the linear takes instead of quantizing again: one kernel
on CUDA (layers/triton_fused.py) instead of two; the same torch ops, in the same order, on CPU.

On by default since the H200 ran the fused kernels (benchmarks/results/h200/fp8_fused_quant.json, at
950ea0e): their bytes and scales equal the separate pair's at 1 to 1,024 tokens (the GPU tests and the
bench); at 4,096 tokens the SiLU kernel is still equal but the norm's differs in some rows (the two
kernels are specializations of one Triton function, so the compiler may order the float32 math
differently: not found yet); a Llama-3.1-8B FP8 decode step is 4-8% faster with the same greedy
tokens. PAGEDSERVE_FP8_FUSE=0 turns it off.
"""
from __future__ import annotations

import os

from torch import nn

FUSE_ENV = "PAGEDSERVE_FP8_FUSE"


def takes_fp8_activation(linear: nn.Module) -> bool:
    return bool(getattr(getattr(linear, "quant_method", None), "takes_fp8_activation", False))


def fusion_enabled() -> bool:
    return os.environ.get(FUSE_ENV, "1").strip().lower() not in ("0", "false", "off")


def fuse_activation_quant(model: nn.Module, enabled: bool | None = None) -> int:
    """Tell every module with a set_fp8_activation_fusion(enabled) -> int hook (a decoder layer)
    whether to fuse; enabled None: from PAGEDSERVE_FP8_FUSE (default on). Returns how many ops now
    hand over quantized activations (0 with no FP8 linear)."""
    enabled = fusion_enabled() if enabled is None else enabled
    return sum(m.set_fp8_activation_fusion(enabled) for m in model.modules()
               if hasattr(m, "set_fp8_activation_fusion"))
