"""split_kv_budget (spec_decode/kv_split.py): the one place that shares the KV budget between the
target's pool and a draft model's. Sizes are exact: the block bytes of real configurations."""
from __future__ import annotations

import pytest

from pagedserve.spec_decode.kv_split import split_kv_budget

GiB = 1 << 30


def block_bytes(layers: int, kv_heads: int, head_dim: int, block_size: int = 16, dtype_bytes: int = 2) -> int:
    return 2 * layers * block_size * kv_heads * head_dim * dtype_bytes  # K and V


# Llama-3.1-8B (32 layers, 8 KV heads of 128) and Llama-3.2-1B (16 layers, 8 KV heads of 64), bf16.
TARGET_8B, DRAFT_1B = block_bytes(32, 8, 128), block_bytes(16, 8, 64)


def test_known_sizes_exact():
    assert (TARGET_8B, DRAFT_1B) == (2 << 20, 512 << 10)  # 2 MiB and 512 KiB per 16-token block
    # 50 GiB of budget: 50 GiB / 2.5 MiB = 20,480 blocks each; the target takes 40 GiB, the draft 10.
    assert split_kv_budget(50 * GiB, TARGET_8B, DRAFT_1B) == (20480, 20480)
    # Same-sized draft: the budget halves.
    assert split_kv_budget(10 * TARGET_8B + 1, TARGET_8B, TARGET_8B) == (5, 5)


@pytest.mark.parametrize("budget", [3 * (2 << 20) + 5, 7 * GiB + 12345, 80 * GiB - 1])
@pytest.mark.parametrize("target,draft", [(TARGET_8B, DRAFT_1B), (4096, 8192), (1000, 1)])
def test_same_tokens_and_the_sum_fits(budget, target, draft):
    t, d = split_kv_budget(budget, target, draft)
    assert t == d >= 1                                   # same blocks of the same size: same tokens
    assert t * target + d * draft <= budget              # both pools fit the budget
    assert (t + 1) * target + (d + 1) * draft > budget   # and nothing of a pair is left over
    # The target's share is target / (target + draft) of the budget, to within one pair of blocks.
    assert abs(t * target - budget * target / (target + draft)) <= target


@pytest.mark.parametrize("budget", [-GiB, 0, TARGET_8B, TARGET_8B + DRAFT_1B - 1])
def test_no_room_for_a_block_of_each_names_the_fields(budget):
    with pytest.raises(ValueError, match="gpu_memory_utilization.*speculative_config.model"):
        split_kv_budget(budget, TARGET_8B, DRAFT_1B)
    assert split_kv_budget(TARGET_8B + DRAFT_1B, TARGET_8B, DRAFT_1B) == (1, 1)
