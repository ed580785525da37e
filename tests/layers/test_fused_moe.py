"""The MoE layer on CPU: the torch path against the per-pair definition in float64, the device-side
sort/pad layout's invariants, and routing against HF's routers (the models' own tests compare
whole tiny MoE models with HF: tests/models/test_model_logits.py, tests/engine/test_greedy.py)."""
import json

import pytest
import torch

from moe_cases import experts, fp8_experts, routings, tokens
from pagedserve.layers.fused_moe.align import align_block_size, max_padded_rows
from pagedserve.layers.fused_moe.config import config_file_name, default_config, get_config
from pagedserve.layers.fused_moe.reference import fused_experts_naive, fused_experts_torch
from pagedserve.layers.fused_moe.routing import select_experts

E, H, I, TOPK, T = 6, 24, 20, 2, 7


@pytest.mark.parametrize("case", list(routings(T, E, TOPK)))
def test_torch_path_equals_naive_per_pair_loop(case):
    w13, w2 = experts(E, H, I)
    weights, ids = routings(T, E, TOPK)[case]
    x = tokens(weights.shape[0], H)
    got = fused_experts_torch(x, w13, w2, weights, ids)
    torch.testing.assert_close(got.double(), fused_experts_naive(x, w13, w2, weights, ids), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("case", list(routings(T, E, TOPK)))
def test_fp8_torch_path_equals_naive_loop_over_dequantized_experts(case):
    """W8A8 experts: the torch path (per expert, per-token activation scales) against the float64
    per-pair loop over the dequantized weights with each GEMM input rounded to fp8 per row; the
    two differ only by float32 rounding in the sums (an fp8 rounding flipped by it would show as
    one e4m3 step, 2^-4 relative, on one element)."""
    w13, w2 = experts(E, H, I)
    q13, q2, s13, s2 = fp8_experts(w13, w2)
    weights, ids = routings(T, E, TOPK)[case]
    x = tokens(weights.shape[0], H)
    got = fused_experts_torch(x, q13, q2, weights, ids, w13_scale=s13, w2_scale=s2)
    want = fused_experts_naive(x, q13, q2, weights, ids, w13_scale=s13, w2_scale=s2)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
    # and W8A8 stays near the full-precision experts: two e4m3 roundings (2^-4 relative at most)
    # per product in each of two GEMMs, a few percent overall (measured 2-7% on these 20-24 term sums)
    full = fused_experts_torch(x, w13, w2, weights, ids)
    assert (got - full).norm() <= 0.1 * full.norm() + 1e-6


def test_fp8_torch_path_needs_its_scales_and_takes_static_activation_scales():
    w13, w2 = experts(E, H, I)
    q13, q2, s13, s2 = fp8_experts(w13, w2)
    weights, ids = routings(T, E, TOPK)["topk"]
    x = tokens(T, H)
    with pytest.raises(ValueError, match="w13_scale and w2_scale"):
        fused_experts_torch(x, q13, q2, weights, ids)
    # A static scale as large as any row's dynamic one: the same result up to fp8's coarser steps.
    dyn = fused_experts_torch(x, q13, q2, weights, ids, w13_scale=s13, w2_scale=s2)
    a13 = x.abs().amax() / 448
    static = fused_experts_torch(x, q13, q2, weights, ids, w13_scale=s13, w2_scale=s2, a13_scale=a13,
                                 a2_scale=torch.tensor(8.0 / 448))  # silu(gate) * up stays below 8 here
    assert not torch.equal(static, dyn)
    assert (static - dyn).norm() <= 0.1 * dyn.norm()


@pytest.mark.parametrize("case", list(routings(T, E, TOPK)))
@pytest.mark.parametrize("block_m", [1, 4, 16])
def test_align_layout(case, block_m):
    _, ids = routings(T, E, TOPK)[case]
    sorted_ids, block_expert, num_padded = align_block_size(ids, E, block_m)
    n = ids.numel()
    flat = ids.reshape(-1).long()
    assert sorted_ids.numel() == max_padded_rows(n, E, block_m)
    used = int(num_padded)
    assert used % block_m == 0 and used <= sorted_ids.numel()
    # Every pair exactly once, in the used rows; sentinels (n) everywhere else.
    real = sorted_ids[:used][sorted_ids[:used] < n]
    assert sorted(real.tolist()) == list(range(n))
    assert (sorted_ids[used:] == n).all()
    # Each used block holds only its expert's pairs, in flat order; experts ascend, the dropped
    # pairs (id E) last in blocks of expert -1; no empty block.
    owner = torch.where(flat == E, -1, flat)
    prev_expert = -1
    for b in range(used // block_m):
        rows = sorted_ids[b * block_m:(b + 1) * block_m]
        e = int(block_expert[b])
        pairs = rows[rows < n]
        rank = E if e == -1 else e
        assert len(pairs) > 0 and rank >= prev_expert
        assert (owner[pairs.long()] == e).all() and pairs.tolist() == sorted(pairs.tolist())
        prev_expert = rank
    assert (block_expert[used // block_m:] == -1).all()
    # An expert with no pair gets no block.
    assert set(block_expert[:used // block_m].tolist()) == set(owner.tolist())


@pytest.mark.parametrize("renormalize", [False, True])
def test_routing_matches_hf_router(renormalize):
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter
    cfg = Qwen3MoeConfig(hidden_size=H, num_experts=E, num_experts_per_tok=3, norm_topk_prob=renormalize)
    router = Qwen3MoeTopKRouter(cfg)
    torch.nn.init.normal_(router.weight)
    x = tokens(T, H)
    _, hf_w, hf_ids = router(x)
    w, ids = select_experts(x @ router.weight.T, 3, renormalize)
    assert ids.dtype == torch.int32 and torch.equal(ids.long(), hf_ids)
    torch.testing.assert_close(w, hf_w, rtol=1e-6, atol=1e-7)


def test_routing_rejects_top_k_above_experts():
    with pytest.raises(ValueError, match=r"num_experts_per_tok \(7\) must be in \[1, num_experts \(6\)\]"):
        select_experts(torch.zeros(2, 6), 7, True)


def test_block_size_table_and_default(tmp_path, monkeypatch):
    from pagedserve.layers.fused_moe import config as moe_config
    monkeypatch.setattr(moe_config, "CONFIG_DIR", tmp_path)
    moe_config.load_table.cache_clear()
    moe_config._get_config.cache_clear()
    assert get_config(4, E, H, I, TOPK, torch.bfloat16, torch.device("cpu")) == default_config(4, E, TOPK)
    entry = dict(BLOCK_M=32, BLOCK_N=128, BLOCK_K=64, GROUP_M=4, num_warps=8, num_stages=4)
    small = {**entry, "BLOCK_M": 16}
    name = config_file_name(E, H, I, torch.bfloat16, "cpu")
    (tmp_path / name).write_text(json.dumps({"1": small, "64": entry}))
    moe_config.load_table.cache_clear()
    moe_config._get_config.cache_clear()
    try:
        assert get_config(2, E, H, I, TOPK, torch.bfloat16, torch.device("cpu")) == small
        assert get_config(50, E, H, I, TOPK, torch.bfloat16, torch.device("cpu")) == entry
        # FP8 experts have their own key (vLLM's fp8_w8a8 name); absent, the safe default covers them
        fp8_name = config_file_name(E, H, I, torch.float8_e4m3fn, "cpu")
        assert "dtype=fp8_w8a8" in fp8_name
        assert get_config(50, E, H, I, TOPK, torch.float8_e4m3fn, torch.device("cpu")) == default_config(50, E, TOPK)
        (tmp_path / fp8_name).write_text(json.dumps({"64": {**entry, "BLOCK_K": 128}}))
        moe_config.load_table.cache_clear()
        moe_config._get_config.cache_clear()
        assert get_config(50, E, H, I, TOPK, torch.float8_e4m3fn, torch.device("cpu")) == {**entry, "BLOCK_K": 128}
    finally:
        moe_config.load_table.cache_clear()
        moe_config._get_config.cache_clear()


def test_align_replays_like_a_cuda_graph():
    """The sort/pad reads no value on the host: recorded once (tests/recorded_graph.py, a CUDA
    graph's semantics on CPU) and replayed after the routing changed in place, it gives what a
    fresh call gives."""
    from recorded_graph import RecordedGraph
    first, *others = [ids for _, ids in routings(T, E, TOPK).values() if ids.shape[0] == T]
    assert len(others) >= 2
    ids = first.clone()
    graph = RecordedGraph()
    graph.capture_begin()
    outs = align_block_size(ids, E, 4)
    graph.capture_end()
    for new_ids in others:
        ids.copy_(new_ids)
        graph.replay()
        for got, want in zip(outs, align_block_size(new_ids, E, 4)):
            assert torch.equal(got, want)


def test_torch_path_is_not_graph_capturable(monkeypatch):
    """A model on the torch MoE path (CPU here, PAGEDSERVE_FUSED_MOE=0 on CUDA) runs eagerly:
    the runner skips CUDA graphs for it rather than fail mid-capture."""
    from pagedserve.layers import fused
    from pagedserve.layers.fused_moe import FusedMoE
    from pagedserve.runner.cuda_graph import graph_capturable
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), FusedMoE(4, 2, 8, 8, True, True))
    fused.reset()
    try:
        assert not graph_capturable(model)
        monkeypatch.setenv("PAGEDSERVE_FUSED_MOE", "force")
        fused.reset()
        assert graph_capturable(model)
    finally:
        fused.reset()
    assert graph_capturable(torch.nn.Linear(4, 4))
