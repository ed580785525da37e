"""YaRN RoPE scaling (Qwen2.5 / Qwen3 to 128k) against HF transformers, and --hf-overrides, the
way a vLLM user turns it on for a checkpoint whose config.json has none.

The frequencies and the attention factor must be HF's exactly: past the original context an
inv_freq one float32 ulp off shows as ~1e-2 rad at 128k positions (tests/layers/test_rope_long.py).
"""
import json
import shutil
from types import SimpleNamespace

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, Qwen3Config
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding, apply_rotary_pos_emb

from pagedserve.config import EngineConfig
from pagedserve.engine.preflight import check_engine_config
from pagedserve.layers.rotary import RotaryEmbedding, apply_rotary
from pagedserve.models.hf_dir import apply_hf_overrides, get_max_model_len, rope_parameters
from pagedserve.models.loader import load_hf_config

# Qwen3's model cards: serve 131,072 tokens with this over the 32,768 the checkpoints were trained on.
QWEN3_YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}


def qwen3_8b(**rope) -> Qwen3Config:
    """Qwen3-8B's attention geometry and RoPE (no weights needed)."""
    return Qwen3Config(hidden_size=4096, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                       max_position_embeddings=40960, rope_parameters={"rope_type": "default", "rope_theta": 1e6,
                                                                       **rope})


def _positions() -> torch.Tensor:
    gen = torch.Generator().manual_seed(0)
    edges = torch.tensor([0, 1, 32767, 32768, 32769, 65535, 100000, 131071])
    return torch.cat([edges, torch.randint(0, 131072, (56,), generator=gen)])


def test_yarn_cos_sin_match_hf_to_128k():
    cfg = qwen3_8b(**QWEN3_YARN)
    hf = Qwen3RotaryEmbedding(cfg)
    ours = RotaryEmbedding(128, rope_parameters(cfg))
    torch.testing.assert_close(ours.inv_freq, hf.inv_freq.float(), rtol=0, atol=0)
    assert ours.attention_scaling == hf.attention_scaling == pytest.approx(0.1 * torch.log(torch.tensor(4.0)).item() + 1)
    pos = _positions()
    cos, sin = ours(pos, torch.float32)
    hf_cos, hf_sin = hf(torch.zeros(1, pos.numel(), 128), pos[None, :])
    torch.testing.assert_close(cos[:, 0], hf_cos[0], rtol=0, atol=2e-6)
    torch.testing.assert_close(sin[:, 0], hf_sin[0], rtol=0, atol=2e-6)
    # The scaling is in effect: the lowest frequency is 1/4 of the unscaled one, the highest unchanged.
    plain = RotaryEmbedding(128, rope_parameters(qwen3_8b()))
    assert torch.allclose(ours.inv_freq[-1], plain.inv_freq[-1] / 4) and ours.inv_freq[0] == plain.inv_freq[0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_yarn_rotated_qk_match_hf(dtype):
    cfg = qwen3_8b(**QWEN3_YARN)
    hf = Qwen3RotaryEmbedding(cfg)
    ours = RotaryEmbedding(128, rope_parameters(cfg))
    pos = _positions()
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(pos.numel(), 32, 128, generator=gen).to(dtype)
    k = torch.randn(pos.numel(), 8, 128, generator=gen).to(dtype)
    cos, sin = ours(pos, dtype)
    hf_cos, hf_sin = hf(q.transpose(0, 1)[None], pos[None, :])
    hf_q, hf_k = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], hf_cos, hf_sin)
    torch.testing.assert_close(apply_rotary(q, cos, sin), hf_q[0].transpose(0, 1), rtol=0, atol=1e-6)
    torch.testing.assert_close(apply_rotary(k, cos, sin), hf_k[0].transpose(0, 1), rtol=0, atol=1e-6)


@pytest.mark.parametrize("rope,partial", [
    ({"factor": None}, 1.0),                                       # factor from max_position_embeddings
    ({"factor": 40.0, "mscale": 1.0, "mscale_all_dim": 0.707}, 1.0),  # DeepSeek's attention-factor form
    ({"attention_factor": 1.25}, 1.0),
    ({"beta_fast": 16, "beta_slow": 2}, 1.0),
    ({"truncate": False}, 1.0),
    ({}, 0.5),                                                     # partial rotary: the rotated dims only
    ({"factor": 1.0}, 1.0),                                        # no scaling: factor 1, attention 1
])
def test_yarn_variants_match_hf(rope, partial):
    cfg = qwen3_8b(**{**QWEN3_YARN, **rope})
    cfg.partial_rotary_factor = partial
    cfg.rope_parameters["partial_rotary_factor"] = partial
    hf_inv, hf_scale = ROPE_INIT_FUNCTIONS["yarn"](cfg, "cpu")
    ours = RotaryEmbedding(128, rope_parameters(cfg), partial)
    torch.testing.assert_close(ours.inv_freq, hf_inv.float(), rtol=0, atol=0)
    assert ours.attention_scaling == pytest.approx(hf_scale, rel=1e-12)


def test_yarn_frequencies_are_computed_on_the_cpu_whatever_the_build_device():
    """The loader builds a model under its device (torch.device(...)): YaRN's frequencies are still
    the CPU's, HF's bit for bit (a GPU's pow may differ by an ulp: ~1e-2 rad at 128k positions)."""
    cfg = qwen3_8b(**QWEN3_YARN)
    with torch.device("meta"):
        ours = RotaryEmbedding(128, rope_parameters(cfg))
    assert ours.inv_freq.device.type == "cpu"
    torch.testing.assert_close(ours.inv_freq, Qwen3RotaryEmbedding(cfg).inv_freq.float(), rtol=0, atol=0)


def test_yarn_defaults_as_hf_fills_them():
    """A config.json (transformers 4's names) that leaves out YaRN's original length gets
    max_position_embeddings, as transformers fills it in; the limit is then that x factor."""
    raw = SimpleNamespace(max_position_embeddings=32768, rope_theta=1e6,
                          rope_scaling={"rope_type": "yarn", "factor": 4.0})
    params = rope_parameters(raw)
    assert params["original_max_position_embeddings"] == 32768 and params["rope_theta"] == 1e6
    assert params == rope_parameters(qwen3_8b(rope_type="yarn", factor=4.0, original_max_position_embeddings=32768))
    assert get_max_model_len(raw) == 131072


def test_model_limit_follows_rope_scaling_as_vllm_does():
    assert get_max_model_len(qwen3_8b()) == 40960
    assert get_max_model_len(qwen3_8b(**QWEN3_YARN)) == 131072  # original x factor, not 40960 x 4
    assert get_max_model_len(qwen3_8b(rope_type="linear", factor=2.0)) == 81920
    llama31 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}
    cfg = qwen3_8b(**llama31)
    cfg.max_position_embeddings = 131072
    assert get_max_model_len(cfg) == 131072  # llama3 configs state the scaled limit already


def test_overrides_merge_rope_and_keep_the_checkpoint_theta():
    cfg = apply_hf_overrides(qwen3_8b(), {"rope_scaling": dict(QWEN3_YARN)})
    assert cfg.rope_parameters == {**QWEN3_YARN, "rope_theta": 1e6}
    hf = Qwen3RotaryEmbedding(cfg)  # HF reads the overridden config as it would the file
    torch.testing.assert_close(RotaryEmbedding(128, rope_parameters(cfg)).inv_freq, hf.inv_freq.float(),
                               rtol=0, atol=0)
    # rope_theta at the top (transformers 4's field) joins the RoPE parameters too.
    cfg = apply_hf_overrides(qwen3_8b(), {"rope_theta": 5e5, "rope_scaling": dict(QWEN3_YARN)})
    assert rope_parameters(cfg) == {**QWEN3_YARN, "rope_theta": 5e5}
    # Other fields replace the config's; a field the config does not have is refused, not ignored.
    assert apply_hf_overrides(qwen3_8b(), {"max_position_embeddings": 65536}).max_position_embeddings == 65536
    with pytest.raises(ValueError, match="no field 'max_postion_embeddings'"):
        apply_hf_overrides(qwen3_8b(), {"max_postion_embeddings": 65536})


@pytest.mark.parametrize("bad,match", [
    ([1, 2], "hf_overrides must be a JSON object"),
    ({"rope_scaling": "yarn"}, "rope_scaling must be an object"),
])
def test_engine_config_refuses_malformed_overrides(bad, match):
    with pytest.raises(ValueError, match=match):
        EngineConfig(model=None, hf_overrides=bad)


@pytest.fixture(scope="module")
def yarn_dirs(tiny_model_dir, tmp_path_factory):
    """A tiny Qwen3 checkpoint, and its copy whose config.json carries YaRN (original context 64,
    factor 4), as a user would edit it: the reference for the override."""
    plain = tiny_model_dir("qwen3")
    edited = tmp_path_factory.mktemp("qwen3_yarn")
    shutil.copytree(plain, edited, dirs_exist_ok=True)
    raw = json.loads((edited / "config.json").read_text())
    rope = dict(raw.get("rope_parameters") or {"rope_theta": raw.get("rope_theta", 10000.0)})
    raw["rope_parameters"] = {**rope, "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}
    raw.pop("rope_scaling", None)
    (edited / "config.json").write_text(json.dumps(raw))
    return plain, edited


def test_preflight_and_engine_limit_with_the_override(yarn_dirs):
    plain, _ = yarn_dirs
    yarn = {"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}}
    with pytest.raises(ValueError, match="beyond the model's limit of 512"):
        check_engine_config(EngineConfig(model=str(plain), max_model_len=1024, device="cpu"))
    check_engine_config(EngineConfig(model=str(plain), max_model_len=256, device="cpu", hf_overrides=yarn))
    with pytest.raises(ValueError, match="beyond the model's limit of 256"):
        check_engine_config(EngineConfig(model=str(plain), max_model_len=512, device="cpu", hf_overrides=yarn))
    assert get_max_model_len(load_hf_config(plain, yarn)) == 256


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA"))])
def test_engine_with_yarn_override_matches_hf_on_the_edited_checkpoint(yarn_dirs, device):
    """Greedy past the original 64 positions: ours with --hf-overrides on the plain checkpoint
    equals HF on the checkpoint whose config.json says YaRN (and differs from HF without it); on
    CUDA through the Triton kernels (the rotary and K/V write in one launch)."""
    from pagedserve import LLM, SamplingParams
    plain, edited = yarn_dirs
    gen = torch.Generator().manual_seed(3)
    prompt = torch.randint(3, 300, (150,), generator=gen).tolist()

    def hf_greedy(path):
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        with torch.no_grad():
            out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                                 max_new_tokens=16, do_sample=False, pad_token_id=2, eos_token_id=None)
        return out[0, len(prompt):].tolist()

    assert AutoConfig.from_pretrained(edited).rope_parameters["rope_type"] == "yarn"
    expected = hf_greedy(edited)
    assert expected != hf_greedy(plain)  # else the comparison could not tell the override took effect
    yarn = {"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}}
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    for path, overrides in ((plain, yarn), (edited, None)):
        llm = LLM(str(path), device=device, dtype="float32", num_gpu_blocks_override=64, swap_space=0.01,
                  hf_overrides=overrides, max_model_len=256, block_size=16)
        out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
        assert out.outputs[0].token_ids == expected, path
