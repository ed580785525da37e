"""Dynamic NTK RoPE scaling (rope_type "dynamic") as vLLM serves it: one base for every position,
HF's dynamic base at the longest length the scaling reaches (the config's limit x factor). HF's own
dynamic recomputes the base from each forward pass's length (unscaled within the limit), which a KV
cache of earlier positions cannot follow; so the engine is compared with HF running the plain RoPE
at that base."""
import json
import shutil

import pytest
import torch
from transformers import AutoConfig, LlamaConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from pagedserve import LLM, SamplingParams
from pagedserve.layers.rotary import RotaryEmbedding, _dynamic_ntk_base
from pagedserve.models.hf_dir import get_max_model_len, rope_parameters
from tests.engine.helpers import hf_greedy


@pytest.mark.parametrize("factor,partial", [(2.0, 1.0), (4.0, 0.5), (2.5, 1.0)])
def test_frequencies_are_hfs_at_the_longest_length(factor, partial):
    cfg = LlamaConfig(hidden_size=4096, num_attention_heads=32, max_position_embeddings=4096,
                      rope_parameters={"rope_type": "dynamic", "factor": factor, "rope_theta": 500000.0,
                                       "partial_rotary_factor": partial})
    ours = RotaryEmbedding(128, rope_parameters(cfg), partial)
    hf, attention = ROPE_INIT_FUNCTIONS["dynamic"](cfg, "cpu", seq_len=int(4096 * factor))
    torch.testing.assert_close(ours.inv_freq, hf, rtol=0, atol=0)
    assert ours.attention_scaling == attention == 1.0
    assert get_max_model_len(cfg) == int(4096 * factor)  # vLLM's limit for it


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA"))])
def test_engine_with_the_override_matches_hf_at_the_scaled_base(tiny_model_dir, tmp_path, device):
    """--hf-overrides with dynamic NTK (factor 2 over the tiny Qwen3's 512 positions): greedy past
    512 positions equals HF on the checkpoint edited to the plain RoPE at the scaled base."""
    plain = tiny_model_dir("qwen3")
    params = rope_parameters(AutoConfig.from_pretrained(plain))
    scaled = _dynamic_ntk_base(params["rope_theta"], 32, {"original_max_position_embeddings": 512, "factor": 2.0})
    edited = tmp_path / "qwen3_ntk"
    shutil.copytree(plain, edited)
    raw = json.loads((edited / "config.json").read_text())
    raw["rope_parameters"] = {"rope_type": "default", "rope_theta": scaled}
    raw.pop("rope_scaling", None)
    (edited / "config.json").write_text(json.dumps(raw))
    prompt = torch.randint(3, 300, (600,), generator=torch.Generator().manual_seed(8)).tolist()
    expected = hf_greedy(edited, prompt, 12, ignore_eos=True)
    assert expected != hf_greedy(plain, prompt, 12, ignore_eos=True)  # else the scaling would not show
    llm = LLM(str(plain), device=device, dtype="float32", num_gpu_blocks_override=96, swap_space=0.01, block_size=16,
              hf_overrides={"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, max_model_len=1024)
    out = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
                       use_tqdm=False)[0]
    assert out.outputs[0].token_ids == expected
