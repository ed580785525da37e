"""Engine configuration: dataclasses validated once, at construction.

EngineConfig holds every `LLM(...)` argument; the core only ever sees the two
small torch-free pieces it needs, CacheConfig and SchedulerConfig.
"""
from __future__ import annotations

from dataclasses import dataclass, field

KV_ALLOCATORS = ("paged", "contiguous-max", "contiguous-pow2", "contiguous-oracle")
PREEMPTION_MODES = ("auto", "recompute", "swap")


@dataclass
class CacheConfig:
    block_size: int = 16
    num_gpu_blocks: int = 0          # filled in by the runner (profiling or override)
    num_cpu_blocks: int = 0          # from swap_space
    enable_prefix_caching: bool = True
    kv_allocator: str = "paged"

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.block_size > 1024:
            raise ValueError(f"block_size must be in [1, 1024], got {self.block_size}")
        if self.kv_allocator not in KV_ALLOCATORS:
            raise ValueError(f"kv_allocator must be one of {KV_ALLOCATORS}, got {self.kv_allocator!r}")


@dataclass
class SchedulerConfig:
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    max_model_len: int = 4096
    enable_chunked_prefill: bool = True
    preemption_mode: str = "auto"
    # Costs for preemption_mode="auto": moving one block over PCIe both ways against recomputing
    # one token. The engine replaces both with the runner's measurements in every CUDA setup
    # (num_gpu_blocks_override or not); these constants remain only on CPU, unless
    # PAGEDSERVE_PROFILE_ON_CPU=1 measures there too (ModelRunner.measures_costs).
    swap_seconds_per_block: float = 2e-5
    recompute_seconds_per_token: float = 5e-5

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {self.max_model_len}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= max_model_len "
                f"({self.max_model_len}) when chunked prefill is off")
        if self.preemption_mode not in PREEMPTION_MODES:
            raise ValueError(f"preemption_mode must be one of {PREEMPTION_MODES}, got {self.preemption_mode!r}")


@dataclass
class EngineConfig:
    model: str | None = None
    tokenizer: str | None = None
    dtype: str = "auto"
    device: str = "auto"
    seed: int = 0
    block_size: int = 16
    gpu_memory_utilization: float = 0.9
    num_gpu_blocks_override: int | None = None
    swap_space: float = 4.0  # GiB of pinned CPU memory for swapped-out blocks
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None
    max_model_len: int | None = None
    enable_prefix_caching: bool = True
    preemption_mode: str = "auto"
    enable_chunked_prefill: bool = True
    enforce_eager: bool = False
    load_format: str = "auto"
    skip_tokenizer_init: bool = False
    tensor_parallel_size: int = 1
    kv_allocator: str = "paged"
    # CPU default pool when no override is given: bounded so a laptop is not exhausted.
    cpu_kv_cache_gib: float = 1.0
    extra: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.num_gpu_blocks_override is not None and self.num_gpu_blocks_override < 1:
            raise ValueError(f"num_gpu_blocks_override must be >= 1, got {self.num_gpu_blocks_override}")
        if self.swap_space < 0:
            raise ValueError(f"swap_space must be >= 0 GiB, got {self.swap_space}")
        if self.dtype not in ("auto", "float32", "float16", "bfloat16", "half", "float", "bf16", "fp16", "fp32"):
            raise ValueError(f"dtype must be auto, float32, float16 or bfloat16, got {self.dtype!r}")
        if self.load_format not in ("auto", "safetensors", "dummy"):
            raise ValueError(f"load_format must be auto, safetensors or dummy, got {self.load_format!r}")
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {self.max_model_len}")
        # Validate the pieces early so a bad argument fails before any model is loaded.
        CacheConfig(block_size=self.block_size, kv_allocator=self.kv_allocator)
        if self.preemption_mode not in PREEMPTION_MODES:
            raise ValueError(f"preemption_mode must be one of {PREEMPTION_MODES}, got {self.preemption_mode!r}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")

    def scheduler_config(self, max_model_len: int) -> SchedulerConfig:
        budget = self.max_num_batched_tokens
        if budget is None:
            budget = 8192 if self.enable_chunked_prefill else max(8192, max_model_len)
        return SchedulerConfig(
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=budget,
            max_model_len=max_model_len,
            enable_chunked_prefill=self.enable_chunked_prefill,
            preemption_mode=self.preemption_mode,
        )
