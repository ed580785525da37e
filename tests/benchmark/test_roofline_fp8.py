"""The roofline's weight bytes against the model pagedserve actually builds: the bytes of every
matmul weight it holds (norms, scales and the gathered embedding left out), in bf16 and with FP8
weights, where the decoder's linear layers and experts hold one byte per weight and the lm head
and MoE routers stay in the model dtype. Also: an FP8 KV cache halves the KV bytes per token."""
import pytest
import torch

from pagedserve.benchmark.roofline import ModelCost
from pagedserve.layers.quant import get_quantization_config
from pagedserve.models.loader import get_model, load_hf_config


def matmul_weight_bytes(model) -> int:
    total = 0
    for name, p in list(model.named_parameters()) + list(model.named_buffers()):
        if name.endswith("weight") and "norm" not in name and "embed_tokens" not in name:
            total += p.numel() * p.element_size()
    return total


@pytest.mark.parametrize("arch", ["llama", "qwen2_moe", "mixtral"])
@pytest.mark.parametrize("fp8", [False, True])
def test_weight_bytes_equal_the_built_models(tiny_model_dir, arch, fp8):
    hf = load_hf_config(tiny_model_dir(arch))
    model = get_model(hf, model_dir=None, device="cpu", dtype=torch.bfloat16, load_format="dummy",
                      quant_config=get_quantization_config("fp8", hf) if fp8 else None)
    cost = ModelCost.from_hf_config(hf, dtype_bytes=2, fp8_weights=fp8)
    assert cost.weight_bytes + cost.expert_bytes * cost.num_experts == matmul_weight_bytes(model)


def test_fp8_halves_what_a_dense_decode_step_reads_but_the_lm_head(tiny_model_dir):
    hf = load_hf_config(tiny_model_dir("llama"))
    bf16, fp8 = ModelCost.from_hf_config(hf), ModelCost.from_hf_config(hf, fp8_weights=True, kv_dtype_bytes=1)
    lm_head = 2 * hf.vocab_size * hf.hidden_size
    assert fp8.weight_bytes - lm_head == (bf16.weight_bytes - lm_head) // 2
    assert fp8.kv_bytes_per_token * 2 == bf16.kv_bytes_per_token
    # Compute: the FP8 GEMMs at twice the rate; the lm head, routers and attention at the bf16 one.
    slow = fp8.step_flops_seconds(64, 64, 1000, flops_rate=1e12, fp8_flops_rate=1e12)
    fast = fp8.step_flops_seconds(64, 64, 1000, flops_rate=1e12, fp8_flops_rate=2e12)
    assert slow - fast == pytest.approx(2 * fp8.fp8_matmul_params * 64 / 2e12)
    assert bf16.step_flops_seconds(64, 64, 1000, 1e12) == pytest.approx(slow)
