"""Llama-3.1's llama3 RoPE scaling at long positions (8k .. 128k) against HF transformers.

Past the original 8k context the rotation angles are position x inv_freq with positions up to
131071, so an inv_freq one float32 ulp off shows as ~1e-2 rad: the frequencies, cos/sin and the
rotated q/k must all match HF's LlamaRotaryEmbedding / apply_rotary_pos_emb at those positions.
"""
import pytest
import torch
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

from pagedserve.layers.rotary import RotaryEmbedding, apply_rotary
from pagedserve.models.hf_dir import rope_parameters

LLAMA31_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192}


@pytest.fixture(scope="module")
def llama31():
    """Llama-3.1-8B's attention geometry and RoPE (no weights needed)."""
    return LlamaConfig(hidden_size=4096, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                       max_position_embeddings=131072, rope_theta=500000.0, rope_scaling=dict(LLAMA31_ROPE))


def _positions() -> torch.Tensor:
    gen = torch.Generator().manual_seed(0)
    edges = torch.tensor([8191, 8192, 8193, 16383, 32768, 65535, 100000, 131071])
    return torch.cat([edges, torch.randint(8192, 131072, (56,), generator=gen)])


def test_llama3_params_are_read_as_hf_reads_them(llama31):
    params = rope_parameters(llama31)
    assert params["rope_type"] == "llama3" and params["rope_theta"] == 500000.0
    assert params["original_max_position_embeddings"] == 8192 and params["factor"] == 8.0


def test_llama3_cos_sin_match_hf_past_8k(llama31):
    hf = LlamaRotaryEmbedding(llama31)
    assert hf.attention_scaling == 1.0  # llama3 scales frequencies only, not the attention
    ours = RotaryEmbedding(128, rope_parameters(llama31))
    torch.testing.assert_close(ours.inv_freq.float(), hf.inv_freq.float(), rtol=0, atol=0)
    pos = _positions()
    cos, sin = ours(pos, torch.float32)
    x = torch.zeros(1, pos.numel(), 128)
    hf_cos, hf_sin = hf(x, pos[None, :])
    torch.testing.assert_close(cos[:, 0], hf_cos[0], rtol=0, atol=1e-6)
    torch.testing.assert_close(sin[:, 0], hf_sin[0], rtol=0, atol=1e-6)
    # The scaling is in effect: the lowest frequency is 1/8 of the unscaled one.
    plain = RotaryEmbedding(128, {"rope_type": "default", "rope_theta": 500000.0})
    assert torch.allclose(ours.inv_freq[-1], plain.inv_freq[-1] / 8)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_llama3_rotated_qk_match_hf_past_8k(llama31, dtype):
    hf = LlamaRotaryEmbedding(llama31)
    ours = RotaryEmbedding(128, rope_parameters(llama31))
    pos = _positions()
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(pos.numel(), 32, 128, generator=gen).to(dtype)
    k = torch.randn(pos.numel(), 8, 128, generator=gen).to(dtype)
    cos, sin = ours(pos, dtype)
    hf_cos, hf_sin = hf(q.transpose(0, 1)[None], pos[None, :])  # cos/sin in q's dtype, as HF casts them
    hf_q, hf_k = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], hf_cos, hf_sin)
    torch.testing.assert_close(apply_rotary(q, cos, sin), hf_q[0].transpose(0, 1), rtol=0, atol=0)
    torch.testing.assert_close(apply_rotary(k, cos, sin), hf_k[0].transpose(0, 1), rtol=0, atol=0)
