"""Compile every Triton W8A8 GEMM variant serving can meet, before the first request.

With PAGEDSERVE_FP8_GEMM=triton or auto, an FP8 linear's GEMM runs triton_fp8_gemm at some token
counts, and which kernel variant it runs depends on the count only through the config
(fp8_gemm_config.get_config: a tuned table's bucket, or the heuristics' buckets): the kernels do not
specialize on M or on the scale strides. The runner's warm-up (runner/warmup.py) runs prefills of
1, 2, 4, ... tokens, which can skip buckets (a table's 24, say) and never meets a tail-only count;
so this runs, per distinct FP8 linear shape of the model, one GEMM at every bucket's token count
(fp8_gemm_config.warmup_token_counts) through fp8_ops.fp8_gemm itself, which under `auto` also
warms cuBLASLt where Triton loses. Under cublas it does nothing (the prefills cover cuBLAS).
No collectives: a tensor-parallel rank warms its own shards.
"""
from __future__ import annotations

import torch
from torch import nn

from pagedserve.layers.quant.fp8 import Fp8LinearMethod
from pagedserve.layers.quant.fp8_gemm_config import warmup_token_counts
from pagedserve.layers.quant.fp8_ops import FP8_DTYPE, fp8_gemm, gemm_mode


@torch.inference_mode()
def warm_up_fp8_gemm(model: nn.Module, max_tokens: int, dtype: torch.dtype) -> int:
    """Run the GEMM of every distinct FP8 linear (weight shape and scale layout) at each
    config-selecting token count up to max_tokens, with output dtype `dtype` (the activations');
    returns the number of calls (0 off CUDA, under cublas, or without FP8 linears)."""
    calls, seen = 0, set()
    for layer in model.modules():
        if not isinstance(getattr(layer, "quant_method", None), Fp8LinearMethod):
            continue
        w, ws = layer.weight, layer.weight_scale
        if not w.is_cuda or w.dtype != FP8_DTYPE or gemm_mode() == "cublas":
            continue
        (n, k), key = w.shape, (tuple(w.shape), ws.numel() == 1)
        if key in seen:
            continue
        seen.add(key)
        for m in warmup_token_counts(n, k, w.device, max_tokens):
            x = torch.zeros(m, k, device=w.device, dtype=FP8_DTYPE)
            fp8_gemm(x, torch.ones(m, 1, device=w.device), w, ws, dtype)
            calls += 1
    return calls
