"""layers/fused.py picks the Triton module on CUDA unless PAGEDSERVE_FUSED=0, plain torch on CPU."""
import pytest
import torch
import triton  # noqa: F401  (a pinned dev dependency: missing must fail, not skip)

from pagedserve.layers import fused


@pytest.fixture(autouse=True)
def _fresh_choice():
    fused.reset()
    yield
    fused.reset()


def test_cuda_gets_triton_unless_switched_off(monkeypatch):
    monkeypatch.delenv("PAGEDSERVE_FUSED", raising=False)
    assert fused.fused_ops(torch.device("cuda")).__name__ == "pagedserve.layers.triton_fused"
    assert fused.fused_ops(torch.device("cpu")) is None
    monkeypatch.setenv("PAGEDSERVE_FUSED", "0")
    assert fused.fused_ops(torch.device("cuda")) is not None  # cached until reset()
    fused.reset()
    assert fused.fused_ops(torch.device("cuda")) is None


def test_sampling_kernels_on_cuda_unless_switched_off(monkeypatch):
    monkeypatch.delenv("PAGEDSERVE_FUSED_SAMPLING", raising=False)
    assert fused.fused_sampling(torch.device("cuda")).__name__ == "pagedserve.layers.triton_sampling"
    assert fused.fused_sampling(torch.device("cpu")) is None
    assert fused.choices(sampling=True) == {"cuda": "triton", "cpu": "torch"}
    monkeypatch.setenv("PAGEDSERVE_FUSED_SAMPLING", "0")
    fused.reset()
    assert fused.fused_sampling(torch.device("cuda")) is None
    monkeypatch.setenv("PAGEDSERVE_FUSED_SAMPLING", "force")
    fused.reset()
    assert fused.fused_sampling(torch.device("cpu")).__name__ == "pagedserve.layers.triton_sampling"


def test_moe_kernels_on_cuda_unless_switched_off(monkeypatch):
    monkeypatch.delenv("PAGEDSERVE_FUSED_MOE", raising=False)
    assert fused.fused_moe_ops(torch.device("cuda")).__name__ == "pagedserve.layers.fused_moe.triton_moe"
    assert fused.fused_moe_ops(torch.device("cpu")) is None
    assert fused.choices(moe=True) == {"cuda": "triton", "cpu": "torch"}
    monkeypatch.setenv("PAGEDSERVE_FUSED_MOE", "0")
    fused.reset()
    assert fused.fused_moe_ops(torch.device("cuda")) is None
