"""The test fixtures themselves: every tiny architecture round-trips through HF."""
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tiny_models import ARCHS


@pytest.mark.parametrize("arch", ARCHS)
def test_tiny_model_loads_in_hf(tiny_model_dir, arch):
    path = tiny_model_dir(arch)
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path)
    ids = tok("Héllo wörld 🚀", return_tensors="pt").input_ids
    assert tok.decode(ids[0]) == "Héllo wörld 🚀"
    out = model(ids).logits
    assert out.shape == (1, ids.shape[1], 384) and len(tok) <= 384 and torch.isfinite(out).all()
