"""FP8 W8A8 linear layers on CPU: the quantize ops and GEMM against dequantized references, load-time
quantization of a model, FP8 checkpoints (compressed-tensors per channel, HF fp8 per tensor) written
here from a tiny model, and the one-line refusals."""
import json

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from pagedserve.attention import AttentionMetadata
from pagedserve.config import EngineConfig
from pagedserve.layers.quant import get_quantization_config
from pagedserve.layers.quant.fp8_ops import (FP8_DTYPE, FP8_MAX, dequantize, fp8_gemm, quantize_per_channel,
                                             quantize_per_token)
from pagedserve.models.loader import get_model, load_hf_config

# e4m3 keeps 3 mantissa bits: a normal value rounds to within 2^-4 of itself, relatively.
E4M3_REL = 2.0 ** -4


def test_quantize_ops_round_within_e4m3_precision():
    torch.manual_seed(0)
    w = torch.randn(48, 32) * torch.logspace(-3, 1, 48)[:, None]  # rows of very different ranges
    wq, ws = quantize_per_channel(w)
    assert wq.dtype == FP8_DTYPE and ws.shape == (48,)
    assert torch.equal(wq.float().abs().amax(1), torch.full((48,), FP8_MAX))  # every row uses the full range
    back = dequantize(wq, ws[:, None])
    big = w.abs() > ws[:, None] * 2 ** -6  # e4m3's normal range; below it the absolute step is what counts
    assert ((back - w).abs()[big] <= E4M3_REL * w.abs()[big]).all()
    assert ((back - w).abs()[~big] <= ws[:, None].expand_as(w)[~big] * 2 ** -9).all()
    x = torch.randn(5, 32)
    x[2] = 0.0  # an all-zero token stays zero (no division by zero)
    xq, xs = quantize_per_token(x)
    assert xs.shape == (5, 1) and torch.equal(dequantize(xq, xs)[2], torch.zeros(32))


def test_fp8_gemm_is_the_dequantized_product_and_close_to_full_precision():
    torch.manual_seed(1)
    x, w, b = torch.randn(7, 64), torch.randn(40, 64) * 0.1, torch.randn(40)
    xq, xs = quantize_per_token(x)
    wq, ws = quantize_per_channel(w)
    y = fp8_gemm(xq, xs, wq, ws, torch.float32, b)
    exact = F.linear(dequantize(xq, xs), dequantize(wq, ws[:, None]), b)
    torch.testing.assert_close(y, exact, rtol=1e-6, atol=1e-6)
    # Against the unquantized layer: two e4m3 roundings per product, averaged over 64 terms.
    rel = (y - F.linear(x, w, b)).norm() / F.linear(x, w, b).norm()
    assert rel < 0.05, rel


def _meta(n: int) -> AttentionMetadata:
    return AttentionMetadata(slot_mapping=torch.arange(n), query_start_loc=torch.tensor([0, n], dtype=torch.int32),
                             seq_lens=torch.tensor([n], dtype=torch.int32),
                             block_tables=torch.arange(-(-n // 16), dtype=torch.int32)[None],
                             num_decodes=0, max_query_len=n, max_seq_len=n, block_size=16,
                             query_lens_cpu=[n], seq_lens_cpu=[n])


def _logits(model, ids: list[int], kv_dtype=torch.float32) -> torch.Tensor:
    cfg = model.config
    hd = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    n = len(ids)
    caches = [(torch.zeros(-(-n // 16), 16, cfg.num_key_value_heads, hd, dtype=kv_dtype),
               torch.zeros(-(-n // 16), 16, cfg.num_key_value_heads, hd, dtype=kv_dtype))
              for _ in range(cfg.num_hidden_layers)]
    with torch.no_grad():
        hidden = model(torch.tensor(ids), torch.arange(n), caches, _meta(n))
        return model.compute_logits(hidden).float()


IDS = [5, 17, 99, 3, 250, 41, 7, 7, 120, 64, 33, 200]


def _load(model_dir, quantization=None):
    hf = load_hf_config(model_dir)
    return get_model(hf, model_dir=model_dir, device="cpu", dtype=torch.float32,
                     quant_config=get_quantization_config(quantization, hf))


def test_load_time_fp8_stores_fp8_weights_and_tracks_full_precision(tiny_model_dir):
    model_dir = tiny_model_dir("llama")
    full, q = _load(model_dir), _load(model_dir, "fp8")
    layer = q.model.layers[0]
    for lin in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj):
        assert lin.weight.dtype == FP8_DTYPE and lin.weight_scale.shape == (lin.out_features,)
    ref, got = _logits(full, IDS), _logits(q, IDS)
    # A random tiny model (weights N(0, 0.08), no trained outliers): about 9% relative logit error after
    # two layers of W8A8, measured; the real demo model's figures are in benchmarks/results/cpu/fp8_accuracy.json.
    print("relative logit error", float((got - ref).norm() / ref.norm()),
          "argmax agreement", float((got.argmax(-1) == ref.argmax(-1)).float().mean()))
    assert ((got - ref).norm() / ref.norm()) < 0.15
    assert (got.argmax(-1) == ref.argmax(-1)).float().mean() >= 0.6  # near-ties are common in a random model


def test_activation_quant_fused_into_norms_and_silu_gives_the_same_logits(tiny_model_dir, monkeypatch):
    """Loading with fp8 hands qkv_proj, gate_up_proj and down_proj their input quantized by the op
    before (layers/quant/fusion.py); on CPU the same torch ops run in the same order, so the logits
    equal, exactly, those of a separate quantize in each FP8 linear. (The fused Triton kernels:
    tests/layers/fused_interpret_cases.py.)"""
    from pagedserve.layers.quant.fusion import fuse_activation_quant
    from pagedserve.layers.quant.fp8_ops import Fp8Activation
    monkeypatch.delenv("PAGEDSERVE_FP8_FUSE", raising=False)
    model = _load(tiny_model_dir("llama"), "fp8")
    layer = model.model.layers[0]
    assert layer.input_layernorm.fp8_out and layer.mlp.fp8_act  # on by default
    monkeypatch.setenv("PAGEDSERVE_FP8_FUSE", "0")
    assert fuse_activation_quant(model) == 0 and not layer.input_layernorm.fp8_out
    assert fuse_activation_quant(model, True) == 3 * model.config.num_hidden_layers
    assert layer.input_layernorm.fp8_out and layer.post_attention_layernorm.fp8_out and layer.mlp.fp8_act
    assert not model.model.norm.fp8_out  # before the lm_head, which stays unquantized
    x = torch.randn(3, model.config.hidden_size)
    act = layer.input_layernorm(x)
    assert isinstance(act, Fp8Activation) and act.q.dtype == FP8_DTYPE and act.dtype == torch.float32
    fused = _logits(model, IDS)
    assert fuse_activation_quant(model, False) == 0 and not layer.input_layernorm.fp8_out
    assert torch.equal(_logits(model, IDS), fused)
    assert fuse_activation_quant(model, True) == 3 * model.config.num_hidden_layers
    assert fuse_activation_quant(_load(tiny_model_dir("llama")), True) == 0  # no FP8 linear, nothing to fuse


def test_static_activation_scales_are_not_fused():
    from pagedserve.layers.linear import ReplicatedLinear
    from pagedserve.layers.quant.fp8 import Fp8Config
    from pagedserve.layers.quant.fusion import takes_fp8_activation
    static = Fp8Config(checkpoint_fp8=True, static_activations=True)
    assert not takes_fp8_activation(ReplicatedLinear(8, 4, quant_config=static))  # its scale is the checkpoint's
    assert takes_fp8_activation(ReplicatedLinear(8, 4, quant_config=Fp8Config()))
    assert not takes_fp8_activation(ReplicatedLinear(8, 4))


def _write_fp8_checkpoint(src_dir, dst_dir, *, per_channel: bool, layout: str):
    """Quantize every linear weight of src_dir's checkpoint on its own (q, k, v apart) and save it as
    `layout` (compressed-tensors or HF fp8) with per-channel ([N, 1]) or per-tensor scales."""
    import shutil
    shutil.copytree(src_dir, dst_dir)
    tensors = load_file(str(dst_dir / "model.safetensors"))
    out = {}
    for name, t in tensors.items():
        if name.endswith("proj.weight") and "lm_head" not in name:
            if per_channel:
                wq, s = quantize_per_channel(t)
                out[name], out[name[:-len("weight")] + "weight_scale"] = wq, s[:, None].contiguous()
            else:
                s = t.abs().amax() / FP8_MAX
                out[name] = (t / s).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
                out[name[:-len("weight")] + "weight_scale"] = s.reshape(())
        else:
            out[name] = t
    (dst_dir / "model.safetensors").unlink()
    save_file(out, str(dst_dir / "model.safetensors"))
    cfg = json.loads((dst_dir / "config.json").read_text())
    if layout == "compressed-tensors":
        cfg["quantization_config"] = {
            "quant_method": "compressed-tensors", "format": "float-quantized", "ignore": ["lm_head"],
            "config_groups": {"group_0": {
                "targets": ["Linear"],
                "weights": {"num_bits": 8, "type": "float", "strategy": "channel" if per_channel else "tensor",
                            "dynamic": False, "symmetric": True},
                "input_activations": {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True,
                                      "symmetric": True}}}}
    else:
        cfg["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic"}
    (dst_dir / "config.json").write_text(json.dumps(cfg))
    return out


def test_compressed_tensors_checkpoint_matches_on_the_fly_quantization(tiny_model_dir, tmp_path):
    """Per-channel scales do not care whether q, k, v are quantized apart or fused: the published
    checkpoint and load-time quantization hold the same bytes, so the logits are identical."""
    model_dir = tiny_model_dir("llama")
    _write_fp8_checkpoint(model_dir, tmp_path / "ct", per_channel=True, layout="compressed-tensors")
    loaded, fly = _load(tmp_path / "ct"), _load(model_dir, "fp8")
    a, b = loaded.model.layers[1].self_attn.qkv_proj, fly.model.layers[1].self_attn.qkv_proj
    assert a.weight.dtype == FP8_DTYPE
    assert torch.equal(a.weight.view(torch.uint8), b.weight.view(torch.uint8))
    assert torch.equal(a.weight_scale, b.weight_scale)
    torch.testing.assert_close(_logits(loaded, IDS), _logits(fly, IDS), rtol=0, atol=0)


def test_hf_fp8_per_tensor_checkpoint_fills_each_fused_part_with_its_scale(tiny_model_dir, tmp_path):
    model_dir = tiny_model_dir("llama")
    written = _write_fp8_checkpoint(model_dir, tmp_path / "hf", per_channel=False, layout="fp8")
    loaded, full = _load(tmp_path / "hf"), _load(model_dir)
    qkv = loaded.model.layers[0].self_attn.qkv_proj
    p = "model.layers.0.self_attn."
    want = torch.cat([written[p + f"{x}_proj.weight_scale"].expand(n) for x, n in
                      (("q", qkv.q_size), ("k", qkv.kv_size), ("v", qkv.kv_size))])
    assert torch.equal(qkv.weight_scale, want.float())
    ref, got = _logits(full, IDS), _logits(loaded, IDS)
    assert ((got - ref).norm() / ref.norm()) < 0.15


def test_fp8_with_dummy_weights_runs(tiny_model_dir):
    hf = load_hf_config(tiny_model_dir("llama"))
    model = get_model(hf, model_dir=None, device="cpu", dtype=torch.float32, load_format="dummy",
                      quant_config=get_quantization_config("fp8", hf))
    assert model.model.layers[0].mlp.down_proj.weight.dtype == FP8_DTYPE
    assert torch.isfinite(_logits(model, IDS)).all()


def test_unsupported_quantization_is_refused_in_one_line(tiny_model_dir, tmp_path):
    with pytest.raises(ValueError, match="quantization method 'awq' is not supported"):
        EngineConfig(model="x", quantization="awq")
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        EngineConfig(model="x", kv_cache_dtype="int8")
    hf = load_hf_config(tiny_model_dir("llama"))
    hf.quantization_config = {"quant_method": "gptq", "bits": 4}
    with pytest.raises(ValueError, match="checkpoint quantization method 'gptq'"):
        get_quantization_config(None, hf)
    hf.quantization_config = {"quant_method": "fp8", "weight_block_size": [128, 128]}
    with pytest.raises(ValueError, match="weight_block_size"):
        get_quantization_config(None, hf)
    opt = load_hf_config(tiny_model_dir("opt"))
    with pytest.raises(ValueError, match="OPTForCausalLM has no quantized layers") as e:
        get_model(opt, model_dir=None, device="cpu", dtype=torch.float32, load_format="dummy",
                  quant_config=get_quantization_config("fp8", opt))
    assert "\n" not in str(e.value)


def test_fp8_on_a_gpu_without_fp8_is_refused_in_one_line(monkeypatch):
    from pagedserve.attention.kv_quant import resolve_kv_cache_dtype
    from pagedserve.layers.quant.fp8 import Fp8Config
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100-SXM4-80GB")
    for check, what in ((lambda: Fp8Config().check_device(torch.device("cuda")), "quantization fp8"),
                        (lambda: resolve_kv_cache_dtype("fp8", torch.bfloat16, torch.device("cuda")),
                         "kv_cache_dtype fp8")):
        with pytest.raises(ValueError) as e:
            check()
        msg = str(e.value)
        assert msg.startswith(what) and "A100" in msg and "8.0" in msg and "\n" not in msg
