"""RunnerView: the part of a ModelRunner that its start-up helpers use (kv_sizing.py sizes the KV
pool, warmup.py runs every kernel and graph once). A typing-only Protocol, so those helpers never
import model_runner.py, which imports them; ModelRunner satisfies it.
"""
from __future__ import annotations

from typing import Any, Protocol

import torch

from pagedserve.config import EngineConfig
from pagedserve.runner.batch import ModelInput
from pagedserve.runner.cache_engine import CacheEngine
from pagedserve.runner.step_input import StepInput


class RunnerView(Protocol):
    config: EngineConfig
    device: torch.device
    dtype: torch.dtype
    block_size: int
    max_model_len: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    cache_engine: CacheEngine | None
    profile: dict[str, float]

    @property
    def vocab_size(self) -> int: ...

    @property
    def block_bytes(self) -> int: ...

    def _cpu_pool_blocks(self) -> int: ...

    def _forward(self, inp: ModelInput, kv_caches: Any) -> torch.Tensor: ...

    def execute_model(self, step: StepInput, prev_sampled: torch.Tensor | None = None) -> torch.Tensor | None: ...
