"""MoE tensor parallelism, both ranks simulated in one process: each rank loads only its slice of
every expert's intermediate dimension (or, with expert parallelism, its whole experts), and of the
shared expert's, from the HF checkpoint; its MoE block returns a partial sum, the two partials add
up to the unsharded block's output, and the block all-reduces exactly once. (The two-process gloo run: tests/distributed/test_tp_generate.py.)"""
import pytest
import torch

from pagedserve.layers import linear
from pagedserve.layers.fused_moe import layer as moe_layer
from pagedserve.models import moe as moe_models
from pagedserve.models.loader import get_model, load_hf_config
from tiny_models import MOE_ARCHS


@pytest.mark.parametrize("expert_parallel", [False, True])
@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_moe_block_partials_sum_to_unsharded_with_one_all_reduce(tiny_model_dir, arch, expert_parallel,
                                                                 monkeypatch):
    model_dir = tiny_model_dir(arch)
    cfg = load_hf_config(model_dir)
    calls = []

    def record(x, tp_size=None):
        calls.append(tuple(x.shape))
        return x  # the partial itself: the sum is taken below
    for mod in (linear, moe_layer, moe_models):
        monkeypatch.setattr(mod, "all_reduce", record)
    kw = dict(model_dir=model_dir, device="cpu", dtype=torch.float32)
    full = get_model(cfg, **kw)
    ranks = [get_model(cfg, tp_rank=r, tp_size=2, expert_parallel=expert_parallel, **kw) for r in range(2)]
    x = torch.randn(9, cfg.hidden_size, generator=torch.Generator().manual_seed(0))
    sparse = [i for i, layer in enumerate(full.model.layers) if isinstance(layer.mlp, moe_models.SparseMoeBlock)]
    assert sparse
    for i in sparse:
        experts = [r.model.layers[i].mlp.experts for r in ranks]
        w13 = full.model.layers[i].mlp.experts.w13_weight
        if expert_parallel:  # whole experts: rank r holds experts r*E/2 .. (r+1)*E/2 - 1
            half = w13.shape[0] // 2
            for r in range(2):
                assert torch.equal(experts[r].w13_weight, w13[r * half:(r + 1) * half])
        else:  # every expert, half of its intermediate dimension
            assert experts[0].w13_weight.shape[1] * 2 == w13.shape[1]
        with torch.no_grad():
            expected = full.model.layers[i].mlp(x)
            calls.clear()
            partials = [r.model.layers[i].mlp(x) for r in ranks]
        assert calls == [tuple(x.shape)] * 2  # one all-reduce per rank and layer
        torch.testing.assert_close(partials[0] + partials[1], expected, rtol=1e-5, atol=1e-5)


def test_expert_width_that_does_not_split_is_a_value_error():
    from transformers import Qwen2MoeConfig

    from pagedserve.runner.executor import check_tp_shapes
    cfg = Qwen2MoeConfig(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                         num_experts=4, num_experts_per_tok=2, moe_intermediate_size=26,
                         shared_expert_intermediate_size=48)
    check_tp_shapes(cfg, 2)
    with pytest.raises(ValueError, match=r"tensor_parallel_size \(4\) must divide moe_intermediate_size \(26\)"):
        check_tp_shapes(cfg, 4)


def test_expert_parallel_refusals(tiny_model_dir):
    from pagedserve.runner.executor import check_tp_shapes
    llama = tiny_model_dir("llama")
    with pytest.raises(ValueError, match="enable_expert_parallel: LlamaForCausalLM is not a mixture of experts"):
        get_model(load_hf_config(llama), model_dir=llama, device="cpu", dtype=torch.float32, tp_size=2,
                  expert_parallel=True)
    cfg = load_hf_config(tiny_model_dir("qwen2_moe"))  # 6 experts
    check_tp_shapes(cfg, 2, expert_parallel=True)
    with pytest.raises(ValueError, match=r"tensor_parallel_size \(4\) must divide the number of experts \(6\)"):
        check_tp_shapes(cfg, 4, expert_parallel=True)
