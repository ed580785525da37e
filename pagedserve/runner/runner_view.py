"""RunnerView: the part of a ModelRunner that its start-up helpers use (kv_sizing.py sizes the KV
pool, graph_capture.py captures and releases its CUDA graphs, warmup.py runs every kernel and graph
once). A typing-only Protocol, so those helpers never import model_runner.py, which imports them;
ModelRunner satisfies it.
"""
from __future__ import annotations

from typing import Any, Protocol

import torch
from torch import nn

from pagedserve.config import EngineConfig
from pagedserve.runner.batch import ModelInput
from pagedserve.runner.cache_engine import CacheEngine
from pagedserve.runner.cuda_graph import DecodeCUDAGraphs
from pagedserve.runner.full_graphs import FullCUDAGraphs
from pagedserve.runner.piecewise_graphs import PiecewiseCUDAGraphs
from pagedserve.runner.step_input import StepInput


class RunnerView(Protocol):
    config: EngineConfig
    device: torch.device
    dtype: torch.dtype
    kv_dtype: torch.dtype
    block_size: int
    max_model_len: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    cache_engine: CacheEngine | None
    profile: dict[str, float]
    model: nn.Module | None
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]]
    tp_size: int
    graphs: DecodeCUDAGraphs | None
    piecewise: PiecewiseCUDAGraphs | None
    full_graphs: FullCUDAGraphs | None

    @property
    def vocab_size(self) -> int: ...

    @property
    def block_bytes(self) -> int: ...

    def _cpu_pool_blocks(self) -> int: ...

    def _require(self, what: str) -> None: ...

    def _forward(self, inp: ModelInput, kv_caches: Any) -> torch.Tensor: ...

    def execute_model(self, step: StepInput, prev_sampled: torch.Tensor | None = None) -> torch.Tensor | None: ...
