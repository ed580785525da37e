"""How the KV budget is shared between the target's pool and a draft model's pool.

The one place that decides it (LLMEngine calls it once, at start-up, after the profile). The
budget is what the target alone would have had: gpu_memory_utilization of the device minus both
models' weights (the draft's are loaded before the profile, so its peak counts them), the
profiled forward's activations and what lives outside torch; on CPU, cpu_kv_cache_gib.

Both pools get the same number of blocks of the same block size, so they hold the same number of
tokens: a draft must hold every token the target holds for the running sequences (their verified
tokens, plus k - 1 proposals against the target's k lookahead slots), and a draft pool larger
than the target's could never be used. That is the budget split in proportion to per-token KV
bytes: the target gets target_block_bytes / (target_block_bytes + draft_block_bytes) of it.
"""
from __future__ import annotations


def split_kv_budget(budget_bytes: int, target_block_bytes: int, draft_block_bytes: int) -> tuple[int, int]:
    """(target blocks, draft blocks) for a budget of budget_bytes.

    Invariants: both counts are equal and >= 1; together they fit the budget,
    n * (target_block_bytes + draft_block_bytes) <= budget_bytes; and one block more for each
    would not. A budget too small for one block of each is a ValueError naming the fields that
    size it.
    """
    if target_block_bytes < 1 or draft_block_bytes < 1:
        raise ValueError(f"block bytes must be >= 1, got target {target_block_bytes}, draft {draft_block_bytes}")
    pair = target_block_bytes + draft_block_bytes
    n = max(0, int(budget_bytes)) // pair
    if n < 1:
        raise ValueError(f"no room for the target's and the draft model's KV caches: {max(0, int(budget_bytes))} "
                         f"bytes left after both models' weights, fewer than one block of each ({pair} bytes); "
                         "raise gpu_memory_utilization (cpu_kv_cache_gib on CPU) or pick a smaller "
                         "speculative_config.model")
    return n, n
