"""Compile every Triton MoE kernel variant serving can meet, before the first request.

The grouped GEMM compiles once per block-size config (its constexprs); which config a step gets
depends on its token count (config.get_config: the tuned table's nearest entry, or the default's
two regimes). The runner's warm-up (runner/warmup.py) runs token counts 1, 2, 4, ... only, so
this runs, per distinct MoE shape of the model, one call at every token count that selects a
config: each table entry up to max_tokens, and 1 and max_tokens (the default's decode and
prefill regimes). It runs the layer's own partial (routing, and under expert parallelism the
dropping of other ranks' pairs, then the kernels) without its all-reduce, so tensor-parallel ranks
need not agree on it.
"""
from __future__ import annotations

import torch
from torch import nn

from pagedserve.layers.fused import fused_moe_ops
from pagedserve.layers.fused_moe.config import config_file_name, device_name, load_table
from pagedserve.layers.fused_moe.layer import FusedMoE


def warmup_token_counts(layer: FusedMoE, hidden: int, dtype: torch.dtype, device: torch.device,
                        max_tokens: int) -> list[int]:
    name = config_file_name(layer.num_local_experts, hidden, layer.intermediate_local, dtype, device_name(device))
    table = load_table(name) or {}
    return sorted({1, max_tokens} | {t for t in table if t <= max_tokens})


@torch.inference_mode()
def warm_up_moe(model: nn.Module, max_tokens: int) -> int:
    """Run the kernels at every config-selecting token count; returns the number of calls (0 when
    the model has no MoE layer or they run in torch)."""
    calls, seen = 0, set()
    for layer in (m for m in model.modules() if isinstance(m, FusedMoE)):
        w13 = layer.w13_weight
        ops = fused_moe_ops(w13.device)
        hidden = w13.shape[2]
        key = (layer.num_experts, layer.num_local_experts, layer.expert_start, layer.top_k, hidden,
               layer.intermediate_local, w13.dtype)
        if ops is None or key in seen:
            continue
        seen.add(key)
        gen = torch.Generator(device=w13.device).manual_seed(0)
        act = layer.params_dtype  # the activations' dtype; w13.dtype selects the table (fp8 has its own)
        for t in warmup_token_counts(layer, hidden, w13.dtype, w13.device, max_tokens):
            logits = torch.randn(t, layer.num_experts, generator=gen, device=w13.device, dtype=act)
            layer.partial(torch.zeros(t, hidden, device=w13.device, dtype=act), logits)
            calls += 1
    return calls
