"""Fixtures shared by the draft-model tests: one tiny Llama, and HF transformers' own model of it
(the reference every draft check compares with)."""
import pytest
import torch


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir):
    return tiny_model_dir("llama")


@pytest.fixture(scope="module")
def hf(model_dir):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).eval()
