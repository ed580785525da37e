"""benchmarks/kernels/tune_fused_moe.py's search space without a GPU: --wide keeps every config of the
first cut, repeats none, and adds the kinds of choice vLLM 0.26's H200 table for Mixtral-8x7B makes
where our layer trailed its kernel (moe_layer.json: batch 1, 64, 128): 5 stages, BLOCK_K 128, 8
warps on 64 x 128 tiles. Not its configs as such: our gate/up program holds two BLOCK_N-wide
accumulators (gate and up), so its BLOCK_N covers twice the columns of vLLM's w13 GEMM's."""
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks/kernels"))
import tune_fused_moe as tune  # noqa: E402


def key(c):
    return tuple(sorted(c.items()))


@pytest.mark.parametrize("tokens", [1, 4, 8, 64, 128, 256, 512, 4096])
@pytest.mark.parametrize("experts,top_k,fp8", [(8, 2, False), (128, 8, False), (128, 8, True)])
def test_wide_is_a_superset_without_repeats(tokens, experts, top_k, fp8):
    base = tune.search_space(tokens, experts, top_k, fp8)
    wide = tune.search_space(tokens, experts, top_k, fp8, wide=True)
    assert len({key(c) for c in wide}) == len(wide)
    assert {key(c) for c in base} <= {key(c) for c in wide}
    assert len(wide) > len(base)


@pytest.mark.parametrize("tokens,cfg", [
    (1, dict(BLOCK_M=16, BLOCK_N=128, BLOCK_K=128, GROUP_M=1, num_warps=4, num_stages=5)),
    (64, dict(BLOCK_M=32, BLOCK_N=128, BLOCK_K=128, GROUP_M=16, num_warps=4, num_stages=3)),
    (128, dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=128, GROUP_M=16, num_warps=8, num_stages=4)),
])
def test_wide_adds_the_choices_vllms_h200_table_makes(tokens, cfg):
    assert key(cfg) not in {key(c) for c in tune.search_space(tokens, 8, 2, False)}
    assert key(cfg) in {key(c) for c in tune.search_space(tokens, 8, 2, False, wide=True)}
