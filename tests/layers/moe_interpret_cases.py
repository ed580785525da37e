"""Cases for the Triton MoE kernels (pagedserve/layers/fused_moe/triton_moe.py) under the Triton
interpreter on CPU, against the torch path (reference.py). Tiny shapes: the interpreter is slow.

Not collected on its own: test_fused_interpret.py runs this file in a subprocess with
TRITON_INTERPRET=1 (Triton picks interpreter-or-compiler at import time).

Tolerances: float32 at 1e-5 (the GEMM's summation order is not torch's); bfloat16 within two
bf16 ulps of unit-scale values (atol 2**-6), since the kernel sums the top_k rows in float32 once
where the torch path adds each expert's rounded contribution into the bf16 output in turn.

FP8 experts (W8A8): the kernel scales the float32 accumulator of exact fp8 products where the torch
path multiplies the dequantized values, so float32 results differ by summation order and the
order of the scale multiplies (~1e-7 relative); such a difference can flip the fp8 rounding of one
element of silu(gate) * up (one e4m3 step, 2^-4 relative, of one of I terms of the down product),
hence rtol/atol 1e-4 in float32. In bfloat16 the bf16 tolerances above apply.
"""
import os

import pytest
import torch

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("run through test_fused_interpret.py (needs TRITON_INTERPRET=1 before importing triton)",
                allow_module_level=True)

from interpreter_fixes import apply as _fix_interpreter  # noqa: E402

_fix_interpreter()

from triton.runtime import interpreter  # noqa: E402

from moe_cases import experts, fp8_experts, routings, tokens  # noqa: E402
from pagedserve.layers.fused_moe import triton_moe  # noqa: E402
from pagedserve.layers.fused_moe.reference import fused_experts_torch  # noqa: E402
from pagedserve.layers.fused_moe.routing import select_experts_torch  # noqa: E402

E, H, I, TOPK, T = 4, 40, 24, 2, 5  # H, I not multiples of the blocks: masked edges
SMALL = dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=16, GROUP_M=2, num_warps=4, num_stages=1)


def test_kernels_are_interpreted():
    assert isinstance(triton_moe._moe_gemm_kernel, interpreter.InterpretedFunction)


@pytest.mark.parametrize("case", list(routings(T, E, TOPK)))
def test_fused_experts_matches_torch_fp32(case):
    w13, w2 = experts(E, H, I)
    weights, ids = routings(T, E, TOPK)[case]
    x = tokens(weights.shape[0], H)
    got = triton_moe.fused_experts(x, w13, w2, weights, ids, SMALL, may_drop=case == "dropped_pairs")
    torch.testing.assert_close(got, fused_experts_torch(x, w13, w2, weights, ids), rtol=1e-5, atol=1e-5)


def test_fused_experts_bf16_and_default_config():
    w13, w2 = experts(E, H, I, torch.bfloat16)
    weights, ids = routings(T, E, TOPK)["topk"]
    x = tokens(T, H, torch.bfloat16)
    w = weights.to(torch.bfloat16)  # as Qwen's routers round them
    got = triton_moe.fused_experts(x, w13, w2, w, ids)  # the default block sizes (no table on CPU)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), fused_experts_torch(x, w13, w2, w, ids).float(), rtol=2 ** -7, atol=2 ** -6)


def test_fused_experts_many_tokens_three_per_token_ungrouped():
    w13, w2 = experts(E, H, I)
    weights, ids = routings(33, E, 3)["topk"]
    x = tokens(33, H)
    cfg = dict(SMALL, BLOCK_M=16, GROUP_M=1)
    torch.testing.assert_close(triton_moe.fused_experts(x, w13, w2, weights, ids, cfg),
                               fused_experts_torch(x, w13, w2, weights, ids), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("renormalize", [False, True])
@pytest.mark.parametrize("num_experts,top_k", [(8, 3), (6, 1), (5, 5)])
def test_route_matches_torch(renormalize, num_experts, top_k):
    logits = torch.randn(9, num_experts, generator=torch.Generator().manual_seed(num_experts))
    w, ids = triton_moe.route(logits, top_k, renormalize)
    ref_w, ref_ids = select_experts_torch(logits, top_k, renormalize)
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(w, ref_w, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen2_moe", "mixtral"])
def test_whole_model_with_triton_moe_matches_hf(arch, tmp_path, monkeypatch):
    """The models route through the Triton kernels (forced on CPU) and still give HF's logits:
    the fused parameters' layout, the routing flags and the roundings all reach the kernels."""
    from pagedserve.core.plan import SchedulerOutput
    from pagedserve.layers import fused
    from paged_harness import HandDriver, hf_model, make_runner
    from tiny_models import make_tiny_model

    monkeypatch.setenv("PAGEDSERVE_FUSED_MOE", "force")
    fused.reset()
    calls = []
    real = triton_moe.fused_experts
    monkeypatch.setattr(triton_moe, "fused_experts", lambda *a, **k: calls.append(1) or real(*a, **k))
    try:
        model_dir = make_tiny_model(arch, tmp_path)
        runner = make_runner(model_dir, block_size=8)
        driver = HandDriver(runner)
        prompts = [[5, 17, 33, 101, 7], [9], list(range(3, 30))]
        seqs = [driver.add(p) for p in prompts]
        logits = runner.execute(SchedulerOutput(scheduled=[driver.schedule(s) for s in seqs]))
    finally:
        fused.reset()
    assert calls  # the Triton path ran
    ref = hf_model(model_dir)
    with torch.no_grad():
        expected = torch.stack([ref(torch.tensor([p])).logits[0, -1] for p in prompts])
    torch.testing.assert_close(logits, expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("T,E,top_k", [(7, 6, 2), (1, 128, 8), (33, 8, 3)])
@pytest.mark.parametrize("block_m", [16, 64])
def test_one_program_align_equals_torch_align(T, E, top_k, block_m):
    from pagedserve.layers.fused_moe import align, triton_align
    for _, ids in routings(T, E, top_k).values():
        for got, want in zip(triton_align.align_block_size(ids, E, block_m), align.align_block_size(ids, E, block_m)):
            assert torch.equal(got, want)


def test_fused_experts_above_one_program_align_uses_torch_align(monkeypatch):
    """Past MAX_PAIRS pairs the torch sort/pad runs; the result is the same."""
    from pagedserve.layers.fused_moe import triton_align
    monkeypatch.setattr(triton_align, "MAX_PAIRS", 4)
    w13, w2 = experts(E, H, I)
    weights, ids = routings(T, E, TOPK)["topk"]
    x = tokens(T, H)
    torch.testing.assert_close(triton_moe.fused_experts(x, w13, w2, weights, ids, SMALL),
                               fused_experts_torch(x, w13, w2, weights, ids), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("case", list(routings(T, E, TOPK)))
def test_fp8_fused_experts_matches_torch_fp32(case):
    q13, q2, s13, s2 = fp8_experts(*experts(E, H, I))
    weights, ids = routings(T, E, TOPK)[case]
    x = tokens(weights.shape[0], H)
    scales = dict(w13_scale=s13, w2_scale=s2)
    got = triton_moe.fused_experts(x, q13, q2, weights, ids, SMALL, may_drop=case == "dropped_pairs", **scales)
    torch.testing.assert_close(got, fused_experts_torch(x, q13, q2, weights, ids, **scales), rtol=1e-4, atol=1e-4)


def test_fp8_fused_experts_bf16_static_scales_and_default_config():
    """bfloat16 activations, a checkpoint's static activation scales, the default block sizes."""
    q13, q2, s13, s2 = fp8_experts(*experts(E, H, I))
    weights, ids = routings(T, E, TOPK)["topk"]
    x = tokens(T, H, torch.bfloat16)
    w = weights.to(torch.bfloat16)
    for static in (None, (x.float().abs().amax() / 448, torch.tensor(8.0 / 448))):
        scales = dict(w13_scale=s13, w2_scale=s2)
        if static:
            scales.update(a13_scale=static[0], a2_scale=static[1])
        got = triton_moe.fused_experts(x, q13, q2, w, ids, **scales)
        assert got.dtype == torch.bfloat16
        torch.testing.assert_close(got.float(), fused_experts_torch(x, q13, q2, w, ids, **scales).float(),
                                   rtol=2 ** -7, atol=2 ** -6)


def test_fp8_layer_reaches_the_kernel_with_its_scales(monkeypatch):
    """A FusedMoE quantized at load time (--quantization fp8) runs the Triton path (forced on CPU)
    with its own scales: equal to the torch path over the same fp8 parameters."""
    from pagedserve.layers import fused
    from pagedserve.layers.fused_moe.layer import FusedMoE
    from pagedserve.layers.quant.fp8 import Fp8Config
    layer = FusedMoE(E, TOPK, H, I, renormalize=True, round_weights=False, quant_config=Fp8Config(),
                     prefix="model.layers.0.mlp.experts")
    w13, w2 = experts(E, H, I)
    layer.w13_weight.data.copy_(w13)
    layer.w2_weight.data.copy_(w2)
    layer.quant_method.process_weights_after_loading(layer)
    q13, q2, s13, s2 = fp8_experts(w13, w2)
    assert torch.equal(layer.w13_weight.view(torch.uint8), q13.view(torch.uint8))
    assert torch.equal(layer.w2_weight_scale, s2)
    x, logits = tokens(T, H), torch.randn(T, E, generator=torch.Generator().manual_seed(3))
    calls = []
    real = triton_moe.fused_experts
    monkeypatch.setattr(triton_moe, "fused_experts", lambda *a, **k: calls.append(k) or real(*a, **k))
    monkeypatch.setenv("PAGEDSERVE_FUSED_MOE", "force")
    fused.reset()
    try:
        got = layer(x, logits)
    finally:
        fused.reset()
    assert calls and calls[0]["w13_scale"] is layer.w13_weight_scale
    weights, ids = select_experts_torch(logits, TOPK, True)
    torch.testing.assert_close(got, fused_experts_torch(x, q13, q2, weights, ids, w13_scale=s13, w2_scale=s2),
                               rtol=1e-4, atol=1e-4)
