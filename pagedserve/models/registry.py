"""config.architectures[0] -> model class."""
from __future__ import annotations

from torch import nn

from pagedserve.models.gemma import Gemma2ForCausalLM, Gemma3ForCausalLM, Gemma3TextOfMultimodal
from pagedserve.models.llama import (GraniteForCausalLM, LlamaForCausalLM, MistralForCausalLM, Phi3ForCausalLM,
                                     Qwen2ForCausalLM, Qwen3ForCausalLM, SmolLM3ForCausalLM)
from pagedserve.models.olmo2 import Olmo2ForCausalLM
from pagedserve.models.moe import MixtralForCausalLM, Qwen2MoeForCausalLM, Qwen3MoeForCausalLM
from pagedserve.models.opt import OPTForCausalLM

MODEL_REGISTRY: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": MistralForCausalLM,
    "MinistralForCausalLM": MistralForCausalLM,  # Mistral's block; its sliding layers by config.layer_types
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "Phi3ForCausalLM": Phi3ForCausalLM,
    "GraniteForCausalLM": GraniteForCausalLM,
    "SmolLM3ForCausalLM": SmolLM3ForCausalLM,
    "Gemma2ForCausalLM": Gemma2ForCausalLM,
    "Gemma3ForCausalLM": Gemma3ForCausalLM,
    "Gemma3ForConditionalGeneration": Gemma3TextOfMultimodal,  # text prompts only (hf_dir.text_decoder_view)
    "Olmo2ForCausalLM": Olmo2ForCausalLM,
    "OPTForCausalLM": OPTForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
    "Qwen2MoeForCausalLM": Qwen2MoeForCausalLM,
    "MixtralForCausalLM": MixtralForCausalLM,
}


def supported_architectures() -> list[str]:
    return sorted(MODEL_REGISTRY)


def get_model_class(hf_config) -> type[nn.Module]:
    archs = getattr(hf_config, "architectures", None) or []
    if not archs:
        raise ValueError(f"config.architectures is empty; supported architectures: {supported_architectures()}")
    if archs[0] not in MODEL_REGISTRY:
        raise ValueError(f"architecture {archs[0]!r} is not supported; supported architectures: "
                         f"{supported_architectures()}")
    return MODEL_REGISTRY[archs[0]]
