"""FP8 W8A8 experts: Fp8MoEMethod, the MoE counterpart of fp8.Fp8LinearMethod.

One representation after process_weights_after_loading, whichever way in:
  w13_weight float8_e4m3fn [E, 2I, H], w13_weight_scale float32 [E, 2I]  (per expert, per output row)
  w2_weight  float8_e4m3fn [E, H, I],  w2_weight_scale  float32 [E, H]
and, only for a checkpoint with static activation scales, w13_input_scale / w2_input_scale
(float32 scalars: the largest over every expert and part, as vLLM takes them, so that all experts,
and all ranks, quantize one token the same way). Without them activations are quantized per token,
dynamically (amax / 448 of each row), before each of the two grouped GEMMs.
  - load-time (`quantization="fp8"` over a bf16/fp16/fp32 checkpoint): the experts load in the
    model dtype and each expert's matrices are then quantized per output channel, as the dense
    layers are (fp8_ops.quantize_per_channel, one expert at a time).
  - an FP8 checkpoint (HF `fp8`, compressed-tensors): the experts load as published; a per-tensor
    weight_scale of one expert's gate, up or down fills that part's rows of the per-channel scale
    (nothing is requantized: gate and up keep their own scales inside the fused w13), a per-channel
    one ([N] or [N, 1]) is narrowed to this rank's rows like the weight.
"""
from __future__ import annotations

import torch
from torch import nn

from pagedserve.layers.quant.base import MoEMethod
from pagedserve.layers.quant.fp8_ops import FP8_DTYPE, quantize_per_channel
from pagedserve.layers.weights import materialize


class Fp8MoEMethod(MoEMethod):
    def __init__(self, config):
        self.config = config  # an Fp8Config

    def create_weights(self, layer: nn.Module) -> None:
        e, n, h = layer.num_local_experts, layer.intermediate_local, layer.hidden_size
        dtype = FP8_DTYPE if self.config.checkpoint_fp8 else None  # None: the model dtype, quantized later
        layer.w13_weight = nn.Parameter(torch.empty(e, 2 * n, h, dtype=dtype), requires_grad=False)
        layer.w2_weight = nn.Parameter(torch.empty(e, h, n, dtype=dtype), requires_grad=False)
        layer.w13_weight.weight_loader = layer.weight_loader
        layer.w2_weight.weight_loader = layer.weight_loader
        if not self.config.checkpoint_fp8:
            return
        layer.w13_weight_scale = nn.Parameter(torch.empty(e, 2 * n, dtype=torch.float32), requires_grad=False)
        layer.w2_weight_scale = nn.Parameter(torch.empty(e, h, dtype=torch.float32), requires_grad=False)
        for p in (layer.w13_weight_scale, layer.w2_weight_scale):
            p.weight_loader = lambda param, w, shard_id, expert_id: _load_weight_scale(layer, param, w, shard_id,
                                                                                       expert_id)
        if self.config.static_activations:
            layer.w13_input_scale = nn.Parameter(torch.zeros((), dtype=torch.float32), requires_grad=False)
            layer.w2_input_scale = nn.Parameter(torch.zeros((), dtype=torch.float32), requires_grad=False)
            for p in (layer.w13_input_scale, layer.w2_input_scale):
                p.weight_loader = _load_input_scale
                # every expert's scale counts (the max over all), so every rank reads all of them
                p.num_expert_parts = layer.num_experts * (2 if p is layer.w13_input_scale else 1)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        if self.config.checkpoint_fp8:
            return
        for name in ("w13", "w2"):
            w = getattr(layer, f"{name}_weight").data
            q = torch.empty(w.shape, dtype=FP8_DTYPE, device=w.device)
            scale = torch.empty(w.shape[:2], dtype=torch.float32, device=w.device)
            for e in range(w.shape[0]):  # one expert at a time: a float32 copy of one, not of all
                q[e], scale[e] = quantize_per_channel(w[e])
            setattr(layer, f"{name}_weight", nn.Parameter(q, requires_grad=False))
            setattr(layer, f"{name}_weight_scale", nn.Parameter(scale, requires_grad=False))

    def kernel_args(self, layer: nn.Module) -> dict:
        return {"w13_scale": layer.w13_weight_scale, "w2_scale": layer.w2_weight_scale,
                "a13_scale": getattr(layer, "w13_input_scale", None),  # static: the checkpoint's; None: per token
                "a2_scale": getattr(layer, "w2_input_scale", None)}


def _load_weight_scale(layer: nn.Module, param: torch.Tensor, loaded, shard_id: str, expert_id: int) -> bool:
    local = layer.local_expert(expert_id)
    if local is None:
        return False
    offset, n, start = layer.shard_rows(shard_id)
    scale = materialize(loaded).float().reshape(-1)
    dst = param.data[local].narrow(0, offset, n)
    with torch.no_grad():
        if scale.numel() == 1:
            dst.fill_(scale.item())
        elif scale.numel() >= start + n:
            dst.copy_(scale.narrow(0, start, n))
        else:
            raise ValueError(f"expert {expert_id} {shard_id} weight_scale has {scale.numel()} entries: neither "
                             f"per-tensor (1) nor per-channel (covering rows {start}..{start + n})")
    return True


def _load_input_scale(param: torch.Tensor, loaded, shard_id: str, expert_id: int) -> bool:
    scale = materialize(loaded).float().reshape(-1)
    if scale.numel() != 1:
        raise ValueError(f"expert {expert_id} {shard_id} input_scale must be per-tensor (one number), "
                         f"got {scale.numel()}")
    with torch.no_grad():
        param.data.fill_(max(float(param.data), scale.item()))
    return True
