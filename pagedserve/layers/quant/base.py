"""The two halves of a quantization scheme: the model-wide config and the per-linear method.

A linear layer asks its config for a LinearMethod at construction. The method
  create_weights(layer)               registers the layer's parameters (with weight_loaders),
  process_weights_after_loading(layer) turns what was loaded into what apply reads
                                      (e.g. bf16 -> fp8 + scales), once, after every tensor is in,
  apply(layer, x, bias)               computes x @ W.T (+ bias) on this rank's slice.
Invariant: after process_weights_after_loading, apply needs nothing from the checkpoint.

A mixture-of-experts layer (layers/fused_moe/layer.py) asks for a MoEMethod the same way: it
creates the stacked expert parameters, post-processes them, and names the extra arguments the
grouped GEMM takes (kernel_args: the FP8 scales).
A method with takes_fp8_activation also accepts, as x, an fp8_ops.Fp8Activation (the activation
already quantized per token by the op before the layer; layers/quant/fusion.py).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class LinearMethod:
    takes_fp8_activation = False

    def create_weights(self, layer: nn.Module) -> None:
        raise NotImplementedError

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        pass

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        raise NotImplementedError


class UnquantizedLinearMethod(LinearMethod):
    """A plain weight [out, in] in the model dtype; F.linear."""

    def create_weights(self, layer: nn.Module) -> None:
        layer.weight = nn.Parameter(torch.empty(layer.out_features, layer.in_features), requires_grad=False)
        layer.weight.weight_loader = layer.weight_loader

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return F.linear(x, layer.weight, bias)


class MoEMethod:
    def create_weights(self, layer: nn.Module) -> None:
        raise NotImplementedError

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        pass

    def kernel_args(self, layer: nn.Module) -> dict:
        """Keyword arguments of fused_experts beyond (x, w13, w2, weights, ids)."""
        return {}


class UnquantizedMoEMethod(MoEMethod):
    """w13_weight [E, 2I, H] and w2_weight [E, H, I] in the model dtype."""

    def create_weights(self, layer: nn.Module) -> None:
        e, n, h = layer.num_local_experts, layer.intermediate_local, layer.hidden_size
        layer.w13_weight = nn.Parameter(torch.empty(e, 2 * n, h), requires_grad=False)
        layer.w2_weight = nn.Parameter(torch.empty(e, h, n), requires_grad=False)
        layer.w13_weight.weight_loader = layer.weight_loader
        layer.w2_weight.weight_loader = layer.weight_loader


class QuantizationConfig:
    """How a model's linear layers are quantized. name: the --quantization value it answers to."""
    name: str = ""

    def get_linear_method(self, layer: nn.Module, prefix: str = "") -> LinearMethod:
        raise NotImplementedError

    def get_moe_method(self, layer: nn.Module, prefix: str = "") -> MoEMethod:
        raise ValueError(f"quantization {self.name}: mixture-of-experts layers are not supported")

    def check_device(self, device: torch.device) -> None:
        """Raise ValueError (one line, naming the method and the device) where it cannot run."""

    def describe(self) -> dict:
        return {"method": self.name}
