"""A Gemma3ForConditionalGeneration checkpoint (gemma-3-4b/12b/27b's kind) served as its text
decoder: the config becomes its text_config, the decoder's tensors load under the released names
(language_model.model.*, what transformers itself writes) and under transformers 5's module names
(model.language_model.*), the vision tower is left out, and greedy tokens on text prompts equal
HF's multimodal model given text alone."""
import json
import logging

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForImageTextToText, Gemma3Config, Gemma3ForConditionalGeneration, SiglipVisionConfig

from pagedserve import LLM, SamplingParams
from pagedserve.models.loader import load_hf_config
from tiny_models import tiny_config, train_tokenizer


@pytest.fixture(scope="module")
def multimodal_dirs(tmp_path_factory):
    """(the checkpoint as transformers saves it, the same tensors under transformers 5's module names)."""
    released = tmp_path_factory.mktemp("gemma3-mm")
    train_tokenizer(released)
    text = tiny_config("gemma3", 384)
    vision = SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                image_size=28, patch_size=14)
    cfg = Gemma3Config(text_config=text.to_dict(), vision_config=vision.to_dict(), mm_tokens_per_image=4,
                       image_token_index=383, boi_token_index=381, eoi_token_index=382)
    torch.manual_seed(5)
    model = Gemma3ForConditionalGeneration(cfg)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.08)
    model.save_pretrained(released, safe_serialization=True)
    renamed = tmp_path_factory.mktemp("gemma3-mm-v5-names")
    for f in released.iterdir():
        (renamed / f.name).write_bytes(f.read_bytes())
    tensors = load_file(renamed / "model.safetensors")
    assert any(k.startswith("language_model.model.") for k in tensors)  # the released layout
    save_file({k.replace("language_model.model.", "model.language_model.").replace("vision_tower.", "model.vision_tower.")
               : v for k, v in tensors.items()}, renamed / "model.safetensors", metadata={"format": "pt"})
    return released, renamed


def _hf_greedy(path, prompt, n):
    model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(model(input_ids=torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]


def test_config_is_the_text_decoder(multimodal_dirs):
    cfg = load_hf_config(multimodal_dirs[0])
    assert cfg.architectures == ["Gemma3ForConditionalGeneration"]
    assert (cfg.num_hidden_layers, cfg.sliding_window) == (2, 16)
    assert json.loads((multimodal_dirs[0] / "config.json").read_text())["architectures"] == \
        ["Gemma3ForConditionalGeneration"]


@pytest.mark.parametrize("layout", ["released", "transformers5"])
def test_text_greedy_matches_hf(multimodal_dirs, layout, caplog):
    path = multimodal_dirs[0 if layout == "released" else 1]
    prompts = [list(range(3, 40)), [5, 17, 33, 101, 7]]
    expected = [_hf_greedy(multimodal_dirs[0], p, 10) for p in prompts]
    with caplog.at_level(logging.WARNING, logger="pagedserve.models.loader"):
        llm = LLM(str(path), device="cpu", dtype="float32", num_gpu_blocks_override=64, swap_space=0.01, block_size=4,
                  max_num_batched_tokens=16)
    assert not [r for r in caplog.records if "no matching parameter" in r.getMessage()]  # every tensor placed or left out
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected
