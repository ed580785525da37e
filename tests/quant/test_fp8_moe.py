"""FP8 mixture-of-experts models on CPU: load-time quantization of tiny Qwen3-MoE, Qwen2-MoE (its
shared expert a plain FP8 MLP) and Mixtral against their full-precision selves, generation through
the engine against an unpaged greedy loop over the same FP8 model, FP8 checkpoints written here
(compressed-tensors per channel; HF fp8 per tensor with static activation scales, Mixtral's
w1/w2/w3 names) against on-the-fly quantization, the ranks' slices of the expert scales under
tensor and expert parallelism, and the ignore list. The layer-level tests (torch path vs a naive
loop, the Triton kernel under the interpreter) are in tests/layers."""
import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from pagedserve.layers.quant import get_quantization_config
from pagedserve.layers.quant.fp8_ops import FP8_DTYPE, FP8_MAX, quantize_per_channel
from pagedserve.models.loader import get_model, load_hf_config
from pagedserve.models.moe import SparseMoeBlock
from test_fp8_linear import IDS, _load, _logits

QUANTIZED = ("_proj.weight", ".w1.weight", ".w2.weight", ".w3.weight")  # not the routers, not lm_head


def _sparse_blocks(model) -> list[SparseMoeBlock]:
    return [layer.mlp for layer in model.model.layers if isinstance(layer.mlp, SparseMoeBlock)]


@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen2_moe", "mixtral"])
def test_load_time_fp8_moe_stores_fp8_experts_and_tracks_full_precision(tiny_model_dir, arch):
    model_dir = tiny_model_dir(arch)
    full, q = _load(model_dir), _load(model_dir, "fp8")
    blocks = _sparse_blocks(q)
    assert blocks
    for block in blocks:
        e = block.experts
        assert e.w13_weight.dtype == FP8_DTYPE and e.w2_weight.dtype == FP8_DTYPE
        assert e.w13_weight_scale.shape == e.w13_weight.shape[:2]
        assert e.w2_weight_scale.shape == e.w2_weight.shape[:2]
        assert block.gate.weight.dtype == torch.float32  # the router stays in the model dtype
        if arch == "qwen2_moe":
            assert block.shared_expert.gate_up_proj.weight.dtype == FP8_DTYPE
            assert block.shared_expert.down_proj.weight.dtype == FP8_DTYPE
            assert block.shared_expert_gate.weight.dtype == torch.float32
    # The stacked experts hold exactly what quantizing each expert's matrix alone gives.
    e_full, e_q = _sparse_blocks(full)[0].experts, blocks[0].experts
    wq, scale = quantize_per_channel(e_full.w2_weight[1])
    assert torch.equal(e_q.w2_weight[1].view(torch.uint8), wq.view(torch.uint8))
    assert torch.equal(e_q.w2_weight_scale[1], scale)
    ref, got = _logits(full, IDS), _logits(q, IDS)
    rel = float((got - ref).norm() / ref.norm())
    # Random tiny models (weights N(0, 0.08)): measured 8-10% relative logit error after two layers of
    # W8A8 attention and experts, as the dense tiny Llama's 9% (tests/quant/test_fp8_linear.py).
    agree = float((got.argmax(-1) == ref.argmax(-1)).float().mean())
    print(arch, "relative logit error", rel, "argmax agreement", agree)
    assert rel < 0.15
    assert agree >= 0.6  # near-ties are common in a random model


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_fp8_moe_engine_generates_the_models_own_greedy_tokens(tiny_model_dir, arch):
    """Through the engine (paged KV cache, batched decode) the FP8 model gives the tokens of an
    unpaged greedy loop over the same FP8 model: per-token activation scales do not depend on the batch."""
    from engine.helpers import make_llm
    from pagedserve import SamplingParams
    model_dir = tiny_model_dir(arch)
    prompts, n = [[5, 17, 99, 3, 250], [41, 7, 7, 120, 64, 33, 200, 9]], 6
    llm = make_llm(model_dir, quantization="fp8")
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True), use_tqdm=False)
    model = _load(model_dir, "fp8")
    for prompt, out in zip(prompts, outs):
        ids = list(prompt)
        for _ in range(n):
            ids.append(int(_logits(model, ids)[-1].argmax()))
        assert out.outputs[0].token_ids == ids[len(prompt):]


def _write_fp8_moe_checkpoint(src_dir, dst_dir, *, layout: str, input_scales: bool = False) -> dict:
    """Every linear weight but the routers' and lm_head, each expert's matrix on its own: per channel
    ([N, 1] scales) for compressed-tensors, per tensor (with static input_scales if asked) for HF fp8."""
    shutil.copytree(src_dir, dst_dir)
    tensors = load_file(str(dst_dir / "model.safetensors"))
    out, g = {}, torch.Generator().manual_seed(7)
    for name, t in tensors.items():
        if not name.endswith(QUANTIZED) or "lm_head" in name:
            out[name] = t
            continue
        stem = name[:-len("weight")]
        if layout == "compressed-tensors":
            wq, s = quantize_per_channel(t)
            out[name], out[stem + "weight_scale"] = wq, s[:, None].contiguous()
        else:
            s = t.abs().amax() / FP8_MAX
            out[name] = (t / s).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
            out[stem + "weight_scale"] = s.reshape(())
            if input_scales:  # calibrated scales, different per expert and part: the layer keeps the max
                out[stem + "input_scale"] = (4.0 + 4.0 * torch.rand((), generator=g)) / FP8_MAX
    (dst_dir / "model.safetensors").unlink()
    save_file(out, str(dst_dir / "model.safetensors"))
    cfg = json.loads((dst_dir / "config.json").read_text())
    if layout == "compressed-tensors":
        cfg["quantization_config"] = {
            "quant_method": "compressed-tensors", "format": "float-quantized",
            "ignore": ["lm_head", "re:.*mlp.gate$", "re:.*shared_expert_gate$"],
            "config_groups": {"group_0": {
                "targets": ["Linear"],
                "weights": {"num_bits": 8, "type": "float", "strategy": "channel", "dynamic": False,
                            "symmetric": True},
                "input_activations": {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True,
                                      "symmetric": True}}}}
    else:
        cfg["quantization_config"] = {"quant_method": "fp8",
                                      "activation_scheme": "static" if input_scales else "dynamic"}
    (dst_dir / "config.json").write_text(json.dumps(cfg))
    return out


@pytest.mark.parametrize("arch", ["qwen2_moe", "mixtral"])
def test_compressed_tensors_moe_checkpoint_equals_on_the_fly_quantization(tiny_model_dir, tmp_path, arch):
    """Per-channel scales per expert: the published checkpoint (one tensor per expert and part, with
    its weight_scale) and load-time quantization of the full-precision experts hold the same bytes
    and scales, so the logits are identical. Qwen2-MoE adds the shared expert and a dense layer."""
    model_dir = tiny_model_dir(arch)
    _write_fp8_moe_checkpoint(model_dir, tmp_path / "ct", layout="compressed-tensors")
    loaded, fly = _load(tmp_path / "ct"), _load(model_dir, "fp8")
    for a, b in zip(_sparse_blocks(loaded), _sparse_blocks(fly)):
        for name in ("w13_weight", "w2_weight"):
            assert getattr(a.experts, name).dtype == FP8_DTYPE
            assert torch.equal(getattr(a.experts, name).view(torch.uint8), getattr(b.experts, name).view(torch.uint8))
            assert torch.equal(getattr(a.experts, name + "_scale"), getattr(b.experts, name + "_scale"))
    torch.testing.assert_close(_logits(loaded, IDS), _logits(fly, IDS), rtol=0, atol=0)


def test_compressed_tensors_moe_ranks_read_their_slices_of_the_scales(tiny_model_dir, tmp_path):
    """Tensor parallelism: each rank's w13 scale rows are its slice of gate's and of up's; w2's
    (hidden) rows are whole. Expert parallelism: a rank's experts are whole, with their own scales."""
    model_dir = tiny_model_dir("qwen3_moe")
    ckpt = tmp_path / "ct"
    _write_fp8_moe_checkpoint(model_dir, ckpt, layout="compressed-tensors")
    hf = load_hf_config(ckpt)
    kw = dict(model_dir=ckpt, device="cpu", dtype=torch.float32, quant_config=get_quantization_config(None, hf))
    full = _sparse_blocks(get_model(hf, **kw))[0].experts
    n = full.intermediate_local // 2
    for rank in range(2):
        tp = _sparse_blocks(get_model(hf, tp_rank=rank, tp_size=2, **kw))[0].experts
        gate, up = full.w13_weight_scale[:, :2 * n], full.w13_weight_scale[:, 2 * n:]
        want = torch.cat([gate[:, rank * n:(rank + 1) * n], up[:, rank * n:(rank + 1) * n]], dim=1)
        assert torch.equal(tp.w13_weight_scale, want)
        assert torch.equal(tp.w2_weight_scale, full.w2_weight_scale)
        ep = _sparse_blocks(get_model(hf, tp_rank=rank, tp_size=2, expert_parallel=True, **kw))[0].experts
        half = full.num_experts // 2
        assert torch.equal(ep.w13_weight_scale, full.w13_weight_scale[rank * half:(rank + 1) * half])
        mine = full.w2_weight[rank * half:(rank + 1) * half]
        assert torch.equal(ep.w2_weight.view(torch.uint8), mine.view(torch.uint8))


def test_hf_fp8_mixtral_per_tensor_static_scales(tiny_model_dir, tmp_path):
    """AutoFP8's Mixtral layout (block_sparse_moe.experts.N.w1/w2/w3, per-tensor weight_scale and
    static input_scale per expert): each part's rows take its scale, the layer's input scales are
    the max over experts, and the logits stay near the full-precision model's."""
    model_dir = tiny_model_dir("mixtral")
    written = _write_fp8_moe_checkpoint(model_dir, tmp_path / "hf", layout="fp8", input_scales=True)
    loaded, full = _load(tmp_path / "hf"), _load(model_dir)
    experts = _sparse_blocks(loaded)[0].experts
    p, n = "model.layers.0.block_sparse_moe.experts.", experts.intermediate_local
    for e in range(experts.num_experts):
        want = torch.cat([written[f"{p}{e}.w1.weight_scale"].expand(n), written[f"{p}{e}.w3.weight_scale"].expand(n)])
        assert torch.equal(experts.w13_weight_scale[e], want.float())
        assert torch.equal(experts.w2_weight_scale[e], written[f"{p}{e}.w2.weight_scale"].expand(experts.hidden_size))
    top13 = max(float(written[f"{p}{e}.{w}.input_scale"]) for e in range(experts.num_experts) for w in ("w1", "w3"))
    top2 = max(float(written[f"{p}{e}.w2.input_scale"]) for e in range(experts.num_experts))
    assert float(experts.w13_input_scale) == top13 and float(experts.w2_input_scale) == top2
    ref, got = _logits(full, IDS), _logits(loaded, IDS)
    assert ((got - ref).norm() / ref.norm()) < 0.15


def test_moe_ignore_list_all_or_none_of_the_experts(tiny_model_dir):
    from pagedserve.layers.quant.fp8 import Fp8Config
    hf = load_hf_config(tiny_model_dir("qwen3_moe"))
    kw = dict(model_dir=None, device="cpu", dtype=torch.float32, load_format="dummy")
    model = get_model(hf, quant_config=Fp8Config(ignored=["re:.*mlp.experts$"]), **kw)
    block = _sparse_blocks(model)[0]
    assert block.experts.w13_weight.dtype == torch.float32  # ignored: full precision
    assert model.model.layers[0].self_attn.qkv_proj.weight.dtype == FP8_DTYPE
    assert torch.isfinite(_logits(model, IDS)).all()
    with pytest.raises(ValueError, match="experts of model.layers.0.mlp.experts are quantized only in part"):
        get_model(hf, quant_config=Fp8Config(ignored=["model.layers.0.mlp.experts.3.down_proj"]), **kw)


def test_fp8_router_in_a_checkpoint_is_refused_naming_it(tiny_model_dir, tmp_path):
    """pagedserve keeps the routers in the model dtype (as vLLM does): a checkpoint that quantized
    one gets a one-line error naming the tensor, not its fp8 values read without their scale."""
    ckpt = tmp_path / "ct"
    _write_fp8_moe_checkpoint(tiny_model_dir("qwen2_moe"), ckpt, layout="compressed-tensors")
    tensors = load_file(str(ckpt / "model.safetensors"))
    name = "model.layers.1.mlp.shared_expert_gate.weight"
    wq, s = quantize_per_channel(tensors[name])
    tensors[name], tensors[name[:-len("weight")] + "weight_scale"] = wq, s[:, None].contiguous()
    save_file(tensors, str(ckpt / "model.safetensors"))
    with pytest.raises(ValueError, match=f"loading {name}: the checkpoint's tensor is FP8") as e:
        _load(ckpt)
    assert "\n" not in str(e.value)
