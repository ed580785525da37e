"""pagedserve: LLM inference and serving on PagedAttention.

`from pagedserve import LLM, SamplingParams` works, but nothing heavy is imported until a
name is used, so torch-free tools (`pagedserve sim`) start fast.
"""
from __future__ import annotations

__version__ = "0.1.0"

_LAZY = {
    "LLM": "pagedserve.entrypoints.llm",
    "LLMEngine": "pagedserve.engine.llm_engine",
    "SamplingParams": "pagedserve.sampling_params",
    "BeamSearchParams": "pagedserve.sampling_params",
    "RequestOutputKind": "pagedserve.sampling_params",
    "StructuredOutputsParams": "pagedserve.sampling_params",
    "RequestOutput": "pagedserve.outputs",
    "CompletionOutput": "pagedserve.outputs",
    "BeamSearchOutput": "pagedserve.outputs",
    "Logprob": "pagedserve.logprobs",
    "EngineConfig": "pagedserve.config",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str):
    if name in _LAZY:
        import importlib
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'pagedserve' has no attribute {name!r}")
