"""Quantized linear layers: a QuantizationConfig says how a checkpoint is quantized, and hands each
linear layer a LinearMethod that creates, loads, post-processes and applies its weights.

vLLM's split (QuantizationConfig / QuantizeMethodBase), our own code. The config comes either
from the user (`quantization="fp8"`: quantize a bf16/fp16/fp32 checkpoint at load time) or
from the checkpoint's config.json `quantization_config` (HF `fp8`, compressed-tensors FP8).
"""
from pagedserve.layers.quant.base import LinearMethod, QuantizationConfig, UnquantizedLinearMethod
from pagedserve.layers.quant.registry import QUANTIZATION_METHODS, get_quantization_config

__all__ = ["LinearMethod", "QuantizationConfig", "UnquantizedLinearMethod", "QUANTIZATION_METHODS",
           "get_quantization_config"]
