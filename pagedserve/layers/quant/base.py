"""The two halves of a quantization scheme: the model-wide config and the per-linear method.

A linear layer asks its config for a LinearMethod at construction. The method
  create_weights(layer)               registers the layer's parameters (with weight_loaders),
  process_weights_after_loading(layer) turns what was loaded into what apply reads
                                      (e.g. bf16 -> fp8 + scales), once, after every tensor is in,
  apply(layer, x, bias)               computes x @ W.T (+ bias) on this rank's slice.
Invariant: after process_weights_after_loading, apply needs nothing from the checkpoint.
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


class QuantizationConfig:
    """How a model's linear layers are quantized. name: the --quantization value it answers to."""
    name: str = ""

    def get_linear_method(self, layer: nn.Module, prefix: str = "") -> LinearMethod:
        raise NotImplementedError

    def check_device(self, device: torch.device) -> None:
        """Raise ValueError (one line, naming the method and the device) where it cannot run."""

    def describe(self) -> dict:
        return {"method": self.name}
