"""LongRoPE (Phi-3, Phi-3.5-mini, Phi-4-mini to 128k) and the Phi-3 family against HF transformers.

HF picks the short or long factors per forward pass (by the longest position in it) and re-prefills
its cache when a sequence crosses the original length; a paged cache keeps one set for every
position, picked by the engine's max_model_len as vLLM picks it. So the engine is compared with HF
where HF's pick is the same for the whole generation: prompts already past the original length
(long), and generations that stay within it (short); and, where they differ, with HF made to use
the long factors throughout.
"""
import json
import math
import shutil
from types import SimpleNamespace

import pytest
import torch
from transformers import AutoModelForCausalLM, Phi3Config
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding

from pagedserve import LLM, SamplingParams
from pagedserve.layers.rotary import RotaryEmbedding
from pagedserve.models.hf_dir import get_max_model_len, rope_parameters
from tiny_models import longrope_parameters, make_tiny_model


def phi4_mini(**rope) -> Phi3Config:
    """Phi-4-mini's attention geometry and RoPE kind: head_dim 128, 3/4 of it rotated, 4,096 trained
    positions stretched to 131,072 (factors of that kind, not the checkpoint's numbers)."""
    return Phi3Config(hidden_size=3072, num_attention_heads=24, num_key_value_heads=8, partial_rotary_factor=0.75,
                      max_position_embeddings=131072, original_max_position_embeddings=4096,
                      rope_parameters={**longrope_parameters(96, 4096, seed=1), **rope})


def _ours(cfg, max_positions):
    params = rope_parameters(cfg)
    return RotaryEmbedding(cfg.hidden_size // cfg.num_attention_heads, params, params["partial_rotary_factor"],
                           max_positions)


@pytest.mark.parametrize("rope", [{}, {"attention_factor": 1.3}, {"factor": 16.0}])
@pytest.mark.parametrize("max_positions", [131072, 4096, 4097])
def test_longrope_frequencies_match_hf(rope, max_positions):
    cfg = phi4_mini(**rope)
    ours = _ours(cfg, max_positions)
    long = max_positions > 4096
    hf_freq, hf_attention = ROPE_INIT_FUNCTIONS["longrope"](cfg, "cpu", seq_len=max_positions if long else None)
    torch.testing.assert_close(ours.inv_freq, hf_freq, rtol=0, atol=0)
    assert ours.attention_scaling == hf_attention
    assert ours.rotary_dim == 96


def test_longrope_attention_factor_is_the_papers():
    ours = _ours(phi4_mini(), 131072)
    assert ours.attention_scaling == pytest.approx(math.sqrt(1 + math.log(32) / math.log(4096)))


def test_longrope_cos_sin_match_hf_past_the_original_length():
    """HF's rotary over positions up to 131,071 (so its long factors) against ours built for 128k."""
    cfg = phi4_mini()
    hf = Phi3RotaryEmbedding(cfg)
    ours = _ours(cfg, 131072)
    gen = torch.Generator().manual_seed(0)
    pos = torch.cat([torch.tensor([0, 1, 4095, 4096, 4097, 65535, 131071]), torch.randint(0, 131072, (57,),
                                                                                            generator=gen)])
    cos, sin = ours(pos, torch.float32)
    hf_cos, hf_sin = hf(torch.zeros(1, pos.numel(), 128), pos[None, :])
    torch.testing.assert_close(cos[:, 0], hf_cos[0], rtol=0, atol=2e-6)
    torch.testing.assert_close(sin[:, 0], hf_sin[0], rtol=0, atol=2e-6)
    # and within the original length HF uses the short factors, ours for max_model_len 4096 too
    short = _ours(cfg, 4096)
    within = pos[pos < 4096]
    hf_cos, hf_sin = Phi3RotaryEmbedding(cfg)(torch.zeros(1, within.numel(), 128), within[None, :])
    torch.testing.assert_close(short(within, torch.float32)[0][:, 0], hf_cos[0], rtol=0, atol=2e-6)


def test_longrope_refuses_factor_lists_of_the_wrong_length():
    params = rope_parameters(phi4_mini())
    params["long_factor"] = params["long_factor"][:-1]
    with pytest.raises(ValueError, match="longrope needs 48 factors"):
        RotaryEmbedding(128, params, 0.75, 131072)


def test_config_json_forms_and_limits():
    """What preflight reads from config.json without transformers: Phi-3's early "su" name and its
    original length beside the RoPE dict, which wins over one inside it as HF standardizes them;
    the limit: the position limit (Phi-3-mini-4k's sliding window does not lower it:
    tests/models/test_sliding_window.py)."""
    raw = SimpleNamespace(max_position_embeddings=131072, original_max_position_embeddings=4096, rope_theta=10000.0,
                          rope_scaling={"type": "su", "short_factor": [1.0] * 48, "long_factor": [2.0] * 48})
    params = rope_parameters(raw)
    assert params["rope_type"] == "longrope" and params["original_max_position_embeddings"] == 4096
    assert params["factor"] == 32 and params["rope_theta"] == 10000.0
    assert get_max_model_len(raw) == 131072
    raw.rope_scaling["original_max_position_embeddings"] = 8192
    assert rope_parameters(raw)["original_max_position_embeddings"] == 4096


def test_both_original_lengths_follow_the_installed_transformers():
    """A config with the original length both beside the RoPE dict and in it: which wins changed
    between transformers versions (5.17 on the GPU machine: the dict's 8192; 5.25: the field's 4096).
    A transformers config object keeps what the installed version chose, so the model's RoPE is
    HF's; config.json read raw (preflight, above) takes 5.25's order."""
    scaling = {"type": "su", "short_factor": [1.0] * 48, "long_factor": [2.0] * 48,
               "original_max_position_embeddings": 8192}
    hf = Phi3Config(max_position_embeddings=131072, original_max_position_embeddings=4096, hidden_size=3072,
                    num_attention_heads=32, rope_scaling=dict(scaling))
    ours = rope_parameters(hf)
    assert ours["rope_type"] == "longrope"
    assert ours["original_max_position_embeddings"] == hf.rope_parameters["original_max_position_embeddings"]
    assert ours["factor"] == 131072 / ours["original_max_position_embeddings"]  # as HF derives it, unset


@pytest.fixture(scope="module")
def phi3_dirs(tmp_path_factory):
    """The tiny Phi-3 with 64 trained positions stretched to 512 (its own LongRoPE factors), and a
    copy whose short factors are its long ones: HF on it uses the long factors at every length."""
    stretched = make_tiny_model("phi3", tmp_path_factory.mktemp("phi3"), rope_parameters=longrope_parameters(12, 64),
                                original_max_position_embeddings=64)
    always_long = tmp_path_factory.mktemp("phi3_long")
    shutil.copytree(stretched, always_long, dirs_exist_ok=True)
    raw = json.loads((always_long / "config.json").read_text())
    raw["rope_parameters"]["short_factor"] = raw["rope_parameters"]["long_factor"]
    (always_long / "config.json").write_text(json.dumps(raw))
    return stretched, always_long


def _hf_greedy(path, prompt, n):
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                             max_new_tokens=n, do_sample=False, pad_token_id=2, eos_token_id=None)
    return out[0, len(prompt):].tolist()


def _ours_greedy(path, prompt, n, max_model_len, device="cpu"):
    llm = LLM(str(path), device=device, dtype="float32", num_gpu_blocks_override=64, swap_space=0.01,
              max_model_len=max_model_len, block_size=16)
    out = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True),
                       use_tqdm=False)[0]
    return out.outputs[0].token_ids


def _prompt(n, seed):
    return torch.randint(3, 300, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module")
def phi35_geometry_dir(tmp_path_factory):
    """Phi-3.5-mini's head: 96 features (not a power of two), all of them rotated, LongRoPE from 64."""
    return make_tiny_model("phi3", tmp_path_factory.mktemp("phi35"), hidden_size=192, num_attention_heads=2,
                           num_key_value_heads=1, partial_rotary_factor=1.0,
                           rope_parameters=longrope_parameters(96, 64), original_max_position_embeddings=64)


CUDA = pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"))


@pytest.mark.parametrize("device", ["cpu", CUDA])
@pytest.mark.parametrize("geometry", ["phi4_mini", "phi35_mini"])
def test_engine_matches_hf_past_the_original_length(phi3_dirs, phi35_geometry_dir, device, geometry):
    """A 100-token prompt (past the 64 trained positions): HF's long factors from the first pass,
    ours for max_model_len 256; chunked prefill cuts the prompt, so chunks within 64 use them too.
    On CUDA through the Triton kernels, head_dim 96 among them."""
    model = phi3_dirs[0] if geometry == "phi4_mini" else phi35_geometry_dir
    prompt = _prompt(100, 5)
    expected = _hf_greedy(model, prompt, 16)
    assert _ours_greedy(model, prompt, 16, 256, device) == expected


def test_engine_matches_hf_within_the_original_length(phi3_dirs):
    """max_model_len 64: the short factors, as HF uses them while a sequence fits in 64."""
    stretched, always_long = phi3_dirs
    prompt = _prompt(30, 6)
    expected = _hf_greedy(stretched, prompt, 20)
    assert expected != _hf_greedy(always_long, prompt, 20)  # else the factors would not be told apart
    assert _ours_greedy(stretched, prompt, 20, 64) == expected


def test_engine_keeps_one_factor_set_for_every_position(phi3_dirs):
    """max_model_len 256 and a short prompt: the long factors from the first token (vLLM's rule),
    where HF would start short: ours equals HF made to use the long ones throughout."""
    stretched, always_long = phi3_dirs
    prompt = _prompt(30, 7)
    assert _ours_greedy(stretched, prompt, 20, 256) == _hf_greedy(always_long, prompt, 20)

@pytest.mark.parametrize("device", ["cpu", CUDA])
def test_max_model_len_auto_picks_the_factors_of_the_length_it_fits(phi3_dirs, device):
    """max_model_len auto: the model is built for its own limit (512, the long factors), then the length
    is fitted to the KV cache, here 4 blocks of 16 = 64 positions, within the trained ones: the short
    factors, as --max-model-len 64 picks them and HF uses them (not the long ones of the 512 it was
    built for). On CUDA the graphs are captured after the fit, with the short factors' tables."""
    stretched, always_long = phi3_dirs
    prompt = _prompt(30, 6)
    expected = _hf_greedy(stretched, prompt, 20)
    assert expected != _hf_greedy(always_long, prompt, 20)
    llm = LLM(str(stretched), device=device, dtype="float32", num_gpu_blocks_override=4, swap_space=0.01,
              max_model_len=-1, block_size=16)
    assert llm.llm_engine.max_model_len == 64
    out = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True),
                       use_tqdm=False)[0]
    assert out.outputs[0].token_ids == expected
    # Fitted past the trained positions (64 blocks hold the model's 512), the long factors stay.
    del llm
    assert _ours_greedy(stretched, prompt, 20, -1, device) == _hf_greedy(always_long, prompt, 20)
