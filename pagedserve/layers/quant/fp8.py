"""FP8 W8A8 linear layers: Fp8Config and its Fp8LinearMethod.

Two ways in, one representation out. After process_weights_after_loading every quantized layer
holds weight: float8_e4m3fn [out, in] and weight_scale: float32 [out] (per output channel), and
either input_scale (a static per-tensor activation scale from the checkpoint) or none (dynamic:
each token's own amax / 448, computed in apply).
  - checkpoint_fp8=False (`quantization="fp8"` over a bf16/fp16/fp32 checkpoint): the weight is
    created in the model dtype, loaded as usual, then quantized per output channel.
  - checkpoint_fp8=True (HF `fp8`, compressed-tensors FP8): the weight is created in fp8 and
    loaded as published; a per-tensor weight_scale of a fused part (q, k, v; gate, up) fills that
    part's rows of the per-channel scale, so fused layers stay exact. A static input_scale of
    fused parts keeps the largest (the parts share one input).
"""
from __future__ import annotations

import fnmatch
import re

import torch
from torch import nn

from pagedserve.layers.quant.base import (LinearMethod, QuantizationConfig, UnquantizedLinearMethod,
                                          UnquantizedMoEMethod)
from pagedserve.layers.quant.fp8_ops import (FP8_DTYPE, Fp8Activation, fp8_gemm, gemm_mode, quantize_per_channel,
                                             quantize_per_token, quantize_static, scaled_mm_supported)
from pagedserve.layers.weights import materialize


class Fp8Config(QuantizationConfig):
    name = "fp8"

    def __init__(self, checkpoint_fp8: bool = False, static_activations: bool = False,
                 ignored: list[str] | tuple[str, ...] = (), source: str = "fp8",
                 weight_strategy: str = "channel", kv_cache_scales: bool = False):
        if static_activations and not checkpoint_fp8:
            raise ValueError("quantization fp8: static activation scales need an FP8 checkpoint that carries them")
        self.checkpoint_fp8, self.static_activations = checkpoint_fp8, static_activations
        self.ignored = list(ignored)
        self.source, self.weight_strategy = source, weight_strategy
        self.kv_cache_scales = kv_cache_scales  # the checkpoint carries k_scale / v_scale per layer

    def is_ignored(self, name: str) -> bool:
        """An ignore entry is a module name, a glob, or "re:<regex>" (compressed-tensors' form)."""
        for pattern in self.ignored:
            if pattern.startswith("re:"):
                if re.fullmatch(pattern[3:], name):
                    return True
            elif name == pattern or name.endswith("." + pattern) or fnmatch.fnmatch(name, pattern):
                return True
        return False

    def get_linear_method(self, layer: nn.Module, prefix: str = "") -> LinearMethod:
        parent = prefix.rsplit(".", 1)[0] if "." in prefix else ""
        names = [f"{parent}.{p}" if parent else p for p in layer.checkpoint_parts] or [prefix]
        skipped = [self.is_ignored(n) for n in names]
        if all(skipped) and prefix:
            return UnquantizedLinearMethod()
        if any(skipped):
            raise ValueError(f"quantization {self.source}: the fused parts {names} are quantized only in part; "
                             "pagedserve fuses them into one layer and needs all or none")
        return Fp8LinearMethod(self)

    def get_moe_method(self, layer: nn.Module, prefix: str = ""):
        """The experts of one MoE layer (prefix ...mlp.experts): all quantized or none (an ignore
        entry naming the experts module, or every expert's projections), as for fused parts."""
        from pagedserve.layers.quant.fp8_moe import Fp8MoEMethod
        if prefix and self.is_ignored(prefix):
            return UnquantizedMoEMethod()
        parts = ("gate_proj", "up_proj", "down_proj") if prefix else ()
        skipped = [self.is_ignored(f"{prefix}.{e}.{p}") for e in range(layer.num_experts) for p in parts]
        if skipped and all(skipped):
            return UnquantizedMoEMethod()
        if any(skipped):
            raise ValueError(f"quantization {self.source}: the experts of {prefix} are quantized only in part; "
                             "pagedserve stacks them into one layer and needs all or none")
        return Fp8MoEMethod(self)

    def check_device(self, device: torch.device) -> None:
        device = torch.device(device)
        if device.type == "cuda":
            gemm_mode()  # a bad PAGEDSERVE_FP8_GEMM fails at start-up, not at the first forward
        if device.type == "cuda" and not scaled_mm_supported(device):
            cap = ".".join(map(str, torch.cuda.get_device_capability(device)))
            raise ValueError(f"quantization fp8: {torch.cuda.get_device_name(device)} (compute capability {cap}) "
                             "has no FP8 GEMM; it needs 8.9 or newer (Ada, Hopper, Blackwell)")

    def describe(self) -> dict:
        return {"method": "fp8", "source": self.source, "checkpoint_fp8": self.checkpoint_fp8,
                "weight_scales": "per-channel" if not self.checkpoint_fp8 else self.weight_strategy,
                "activation_scales": "static per-tensor" if self.static_activations else "dynamic per-token"}


class Fp8LinearMethod(LinearMethod):
    def __init__(self, config: Fp8Config):
        self.config = config
        # Dynamic per-token activations may come quantized by the op before (the norm, SiLU-and-mul);
        # a static input_scale is the checkpoint's, which those ops do not know.
        self.takes_fp8_activation = not config.static_activations

    def create_weights(self, layer: nn.Module) -> None:
        out, inp = layer.out_features, layer.in_features
        if not self.config.checkpoint_fp8:
            layer.weight = nn.Parameter(torch.empty(out, inp), requires_grad=False)
            layer.weight.weight_loader = layer.weight_loader
            return
        layer.weight = nn.Parameter(torch.empty(out, inp, dtype=FP8_DTYPE), requires_grad=False)
        layer.weight.weight_loader = layer.weight_loader
        layer.weight_scale = nn.Parameter(torch.empty(out, dtype=torch.float32), requires_grad=False)
        layer.weight_scale.weight_loader = lambda p, w, shard_id=None: _load_weight_scale(layer, p, w, shard_id)
        if self.config.static_activations:
            layer.input_scale = nn.Parameter(torch.zeros((), dtype=torch.float32), requires_grad=False)
            layer.input_scale.weight_loader = _load_input_scale

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        if self.config.checkpoint_fp8:
            return
        wq, scale = quantize_per_channel(layer.weight.data)
        layer.weight = nn.Parameter(wq, requires_grad=False)
        layer.weight_scale = nn.Parameter(scale, requires_grad=False)

    def apply(self, layer: nn.Module, x: torch.Tensor | Fp8Activation, bias: torch.Tensor | None) -> torch.Tensor:
        if isinstance(x, Fp8Activation):  # quantized per token already, by the op before
            shape, dtype = x.q.shape, x.dtype
            xq, x_scale = x.q.reshape(-1, shape[-1]), x.scale
        else:
            shape, dtype = x.shape, x.dtype
            x2 = x.reshape(-1, shape[-1])
            if self.config.static_activations:
                xq, x_scale = quantize_static(x2, layer.input_scale)
            else:
                xq, x_scale = quantize_per_token(x2)
        y = fp8_gemm(xq, x_scale, layer.weight, layer.weight_scale, dtype, bias)
        return y.reshape(*shape[:-1], y.shape[-1])


def _load_weight_scale(layer: nn.Module, param: torch.Tensor, loaded, shard_id) -> None:
    """A per-tensor scale (one number) fills the shard's rows; a per-channel one ([N] or [N, 1]) is
    narrowed to this rank's rows like the weight."""
    scale = materialize(loaded).float().reshape(-1)
    offset, n, start = layer.shard_rows(shard_id)
    with torch.no_grad():
        if scale.numel() == 1:
            param.data.narrow(0, offset, n).fill_(scale.item())
        elif scale.numel() >= start + n:
            param.data.narrow(0, offset, n).copy_(scale.narrow(0, start, n))
        else:
            raise ValueError(f"weight_scale has {scale.numel()} entries: neither per-tensor (1) nor per-channel "
                             f"(covering rows {start}..{start + n})")


def _load_input_scale(param: torch.Tensor, loaded, shard_id=None) -> None:
    scale = materialize(loaded).float().reshape(-1)
    if scale.numel() != 1:
        raise ValueError(f"input_scale must be per-tensor (one number), got {scale.numel()}")
    with torch.no_grad():
        param.data.fill_(max(float(param.data), scale.item()))
