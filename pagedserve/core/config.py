"""The core's configuration: the two small torch-free pieces of EngineConfig (pagedserve/config.py)
that the block manager and the scheduler see, validated at construction."""
from __future__ import annotations

from dataclasses import dataclass

KV_ALLOCATORS = ("paged", "contiguous-max", "contiguous-pow2", "contiguous-oracle")
PREEMPTION_MODES = ("auto", "recompute", "swap")
SCHEDULING_POLICIES = ("fcfs", "priority")


@dataclass
class CacheConfig:
    block_size: int = 16
    num_gpu_blocks: int = 0          # filled in by the runner (profiling or override)
    num_cpu_blocks: int = 0          # from swap_space
    enable_prefix_caching: bool = True
    kv_allocator: str = "paged"
    cache_dtype: str = "auto"        # the pools' element type by name (bfloat16, fp8_e4m3, ...), for stats
    # Every layer's sliding window when all layers share one (0: some layer sees everything):
    # blocks wholly before a sequence's window go back to the pool (kv_cache_manager.py).
    sliding_window: int = 0

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
    # vLLM's: fcfs, or priority (a request's priority, lower first, then arrival: the order of
    # waiting, running and swapped, so also which running request a preemption takes last).
    scheduling_policy: str = "fcfs"
    # vLLM's: a prefill with more tokens left than this takes at most this many a step (0: off).
    long_prefill_token_threshold: int = 0
    # K > 0: in a step with a decode, a prefill token after P earlier tokens of its sequence costs
    # 1 + P / K of the step's budget (core/chunk_cost.py); the engine sets K from the model's shape
    # (EngineConfig.long_prefill_budget_by_cost). 0: every token costs 1.
    attention_cost_context: int = 0
    # Costs count only for sequences of at least this many tokens (the engine sets
    # chunk_cost.COST_MIN_TOKENS): shorter prompts are chunked by tokens alone.
    attention_cost_min_tokens: int = 0
    # N > 0: a prefill chunk cut short by the budget ends on a multiple of N where that leaves it
    # half its tokens or chunk_cost.CHUNK_ALIGN (core/scheduler.py _schedule_prefill). 0: off.
    long_prefill_chunk_align: int = 0
    # N > 0: a fresh prompt of P >= max(N, long_prefill_drain_min_tokens) tokens waits for running
    # requests within a few tokens of their max_tokens, up to P // N steps in all (core/admission.py).
    # 0: off. The engine sets the minimum to chunk_cost.COST_MIN_TOKENS.
    long_prefill_drain: int = 0
    long_prefill_drain_min_tokens: int = 0
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
        if self.long_prefill_token_threshold < 0:
            raise ValueError(f"long_prefill_token_threshold must be >= 0 (0: off), got {self.long_prefill_token_threshold}")
        if self.attention_cost_context < 0:
            raise ValueError(f"attention_cost_context must be >= 0 (0: off), got {self.attention_cost_context}")
        if self.long_prefill_chunk_align < 0:
            raise ValueError(f"long_prefill_chunk_align must be >= 0 (0: off), got {self.long_prefill_chunk_align}")
        if self.long_prefill_drain < 0:
            raise ValueError(f"long_prefill_drain must be >= 0 (0: off), got {self.long_prefill_drain}")
