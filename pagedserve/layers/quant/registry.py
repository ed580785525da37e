"""Which QuantizationConfig a model gets: from the user's `quantization` and the checkpoint's
config.json `quantization_config` (read as vLLM reads it).

  user None,  checkpoint none              -> None (unquantized)
  user "fp8", checkpoint none              -> Fp8Config: quantize at load time
  any,        checkpoint "fp8"             -> HF's FP8 layout (AutoFP8 / transformers): per-tensor
                                              weight_scale, activation_scheme dynamic or static
  any,        checkpoint compressed-tensors-> its FP8 scheme (float, 8 bits; weights per tensor or
                                              per channel; activations dynamic per token or static
                                              per tensor), ignore list, kv_cache_scheme (per
                                              tensor or per KV head: strategy attn_head)
Anything else is refused with one line naming it.
"""
from __future__ import annotations

from pagedserve.config import KV_CACHE_SCALE_STRATEGIES as KV_CACHE_STRATEGIES
from pagedserve.layers.quant.base import QuantizationConfig
from pagedserve.layers.quant.fp8 import Fp8Config

QUANTIZATION_METHODS = ("fp8",)
CHECKPOINT_METHODS = ("fp8", "compressed-tensors")


def _checkpoint_quant(hf_config) -> dict | None:
    q = getattr(hf_config, "quantization_config", None)
    if q is None:
        return None
    if not isinstance(q, dict):
        q = q.to_dict() if hasattr(q, "to_dict") else dict(vars(q))
    return q


def get_quantization_config(quantization: str | None, hf_config) -> QuantizationConfig | None:
    if quantization is not None and quantization not in QUANTIZATION_METHODS:
        raise ValueError(f"quantization method {quantization!r} is not supported (supported: "
                         f"{', '.join(QUANTIZATION_METHODS)})")
    ckpt = _checkpoint_quant(hf_config)
    if ckpt is None:
        return Fp8Config() if quantization == "fp8" else None
    method = str(ckpt.get("quant_method", "")).lower().replace("_", "-")
    if method not in CHECKPOINT_METHODS:
        raise ValueError(f"checkpoint quantization method {method!r} (config.json quantization_config) is not "
                         f"supported (supported: {', '.join(CHECKPOINT_METHODS)} with FP8 weights)")
    if method == "fp8":
        return _hf_fp8(ckpt)
    return _compressed_tensors(ckpt)


def _hf_fp8(ckpt: dict) -> Fp8Config:
    if ckpt.get("weight_block_size"):
        raise ValueError(f"checkpoint quantization fp8 with weight_block_size {ckpt['weight_block_size']} "
                         "(block-wise scales) is not supported; per-tensor and per-channel scales are")
    scheme = ckpt.get("activation_scheme", "dynamic")
    if scheme not in ("dynamic", "static"):
        raise ValueError(f"checkpoint quantization fp8: activation_scheme must be dynamic or static, got {scheme!r}")
    ignored = ckpt.get("ignored_layers") or ckpt.get("modules_to_not_convert") or []
    return Fp8Config(checkpoint_fp8=True, static_activations=scheme == "static", ignored=ignored,
                     source="fp8 checkpoint", weight_strategy="tensor")


def _compressed_tensors(ckpt: dict) -> Fp8Config:
    groups = ckpt.get("config_groups") or {}
    if len(groups) != 1:
        raise ValueError(f"checkpoint quantization compressed-tensors: exactly one config group is supported, "
                         f"got {len(groups)}")
    group = next(iter(groups.values()))
    weights, acts = group.get("weights") or {}, group.get("input_activations")
    if weights.get("type") != "float" or weights.get("num_bits") != 8:
        raise ValueError(f"checkpoint quantization compressed-tensors: only FP8 weights (type float, num_bits 8) "
                         f"are supported, got type {weights.get('type')!r} num_bits {weights.get('num_bits')!r}")
    strategy = weights.get("strategy", "tensor")
    if strategy not in ("tensor", "channel"):
        raise ValueError(f"checkpoint quantization compressed-tensors: weight strategy {strategy!r} is not "
                         "supported (tensor, channel)")
    if not acts or acts.get("type") != "float" or acts.get("num_bits") != 8:
        raise ValueError("checkpoint quantization compressed-tensors: only W8A8 FP8 is supported (input_activations "
                         "must be float, 8 bits); weight-only FP8 is not")
    dynamic = bool(acts.get("dynamic", False))
    if not dynamic and acts.get("strategy", "tensor") != "tensor":
        raise ValueError(f"checkpoint quantization compressed-tensors: static activation strategy "
                         f"{acts.get('strategy')!r} is not supported (tensor)")
    kv = ckpt.get("kv_cache_scheme")
    # strategy "attn_head" (llm-compressor): k_scale / v_scale of [num_kv_heads] (or [H, 1, 1]) per layer
    if kv and (kv.get("type") != "float" or kv.get("num_bits") != 8
               or kv.get("strategy", "tensor") not in KV_CACHE_STRATEGIES):
        raise ValueError(f"checkpoint quantization compressed-tensors: kv_cache_scheme {kv} is not supported "
                         f"(float, 8 bits, strategy {' or '.join(KV_CACHE_STRATEGIES)})")
    if kv and kv.get("symmetric", True) is False:  # zero points pagedserve would ignore (vLLM refuses too)
        raise ValueError(f"checkpoint quantization compressed-tensors: kv_cache_scheme {kv} is asymmetric; "
                         "only symmetric KV-cache scales are supported")
    return Fp8Config(checkpoint_fp8=True, static_activations=not dynamic, ignored=ckpt.get("ignore") or [],
                     source="compressed-tensors", weight_strategy=strategy, kv_cache_scales=bool(kv))
