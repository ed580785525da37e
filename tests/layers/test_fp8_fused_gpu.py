"""FP8 activation quantization fused into RMSNorm and SiLU-and-mul, on CUDA (skipped without a GPU).

At Llama-3.1-8B's sizes in bfloat16: each fused kernel against its separate pair (the op's kernel,
then triton_fp8's per-token quant kernel), bit for bit (fp8 bytes, scales, residual), and against
the torch ops (norm or silu, then quantize_per_token_torch) within the tolerance of
fused_interpret_cases.py (the op's one-ulp differences, and torch's scale division, which is not
IEEE div on the GPU); CUDA-graph capture; and the demo model, --quantization fp8, giving the same
greedy tokens and prompt logprobs with the fusion on and off.
"""
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
HIDDEN, INTER = 4096, 14336
DEMO = Path(__file__).resolve().parents[2] / "pagedserve" / "demo_model"


@pytest.fixture(scope="module")
def ops():
    from pagedserve.layers import triton_fused
    return triton_fused


def _inputs(T, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = 3 * torch.randn(T, HIDDEN, device="cuda", dtype=torch.bfloat16, generator=g)
    res = torch.randn(T, HIDDEN, device="cuda", dtype=torch.bfloat16, generator=g)
    w = (1 + 0.1 * torch.randn(HIDDEN, device="cuda", generator=g)).bfloat16()
    gate_up = 2 * torch.randn(T, 2 * INTER, device="cuda", dtype=torch.bfloat16, generator=g)
    if T > 3:
        x[3], res[3], gate_up[3] = 0.0, 0.0, 0.0
    return x, res, w, gate_up


def _bits(t):
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


def _same_bits(got, want):
    for a, b in zip(got, want):
        assert a.shape == b.shape and torch.equal(_bits(a), _bits(b))


def _close_to_torch(q, scale, ref):
    """Within one bf16 ulp on the scale, one e4m3 step per value, >= 99% of the bytes equal."""
    torch.testing.assert_close(scale, ref.scale, rtol=2 ** -7, atol=0)
    a, b = q.float() * scale, ref.q.float() * ref.scale
    step = torch.maximum(a.abs(), b.abs()) / 8 + torch.maximum(scale, ref.scale) * 2.0 ** -9
    assert ((a - b).abs() <= step).all()
    if q.numel():
        assert (q.view(torch.uint8) == ref.q.view(torch.uint8)).float().mean() >= 0.99


@pytest.mark.parametrize("T", [0, 1, 37, 256, 1000])
def test_fused_kernels_are_bit_equal_to_op_then_quant_kernel(ops, T):
    from pagedserve.layers.quant.triton_fp8 import quantize_per_token
    x, res, w, gate_up = _inputs(T, T)
    _same_bits(ops.rms_norm_fp8(x, w, 1e-5), quantize_per_token(ops.rms_norm(x, w, 1e-5)))
    y, s = ops.fused_add_rms_norm(x, res, w, 1e-5)
    _same_bits(ops.fused_add_rms_norm_fp8(x, res, w, 1e-5), (*quantize_per_token(y), s))
    _same_bits(ops.silu_and_mul_fp8(gate_up), quantize_per_token(ops.silu_and_mul(gate_up)))


@pytest.mark.parametrize("T,inter", [(1, 20000), (37, 16385)])
def test_silu_fp8_rows_past_one_block_are_walked_twice(ops, T, inter):
    """Past 16k features silu_and_mul_fp8 leaves the one-block path for two passes: the same bits."""
    from pagedserve.layers.quant.triton_fp8 import quantize_per_token
    gate_up = 2 * torch.randn(T, 2 * inter, device="cuda", dtype=torch.bfloat16)
    _same_bits(ops.silu_and_mul_fp8(gate_up), quantize_per_token(ops.silu_and_mul(gate_up)))


@pytest.mark.parametrize("T", [1, 256])
def test_fused_kernels_match_torch_ops_then_torch_quant(ops, T, monkeypatch):
    from pagedserve.layers import fused
    from pagedserve.layers.norm import RMSNorm
    from pagedserve.layers.quant.fp8_ops import Fp8Activation, quantize_per_token_torch
    x, res, w, gate_up = _inputs(T, 7 * T)
    monkeypatch.setenv("PAGEDSERVE_FUSED", "0")
    fused.reset()
    try:
        norm = RMSNorm(HIDDEN, 1e-5).cuda().bfloat16()
        norm.weight.data.copy_(w)
        ref_y, ref_s = norm(x, res)
        gate, up = gate_up.chunk(2, dim=-1)
        ref_silu = F.silu(gate) * up
    finally:
        fused.reset()
    q, scale, s = ops.fused_add_rms_norm_fp8(x, res, w, 1e-5)
    assert torch.equal(s, ref_s)
    _close_to_torch(q, scale, Fp8Activation(*quantize_per_token_torch(ref_y), torch.bfloat16))
    _close_to_torch(*ops.silu_and_mul_fp8(gate_up), Fp8Activation(*quantize_per_token_torch(ref_silu), torch.bfloat16))


def test_fused_kernels_capture_in_a_cuda_graph(ops):
    x, res, w, gate_up = _inputs(64, 3)
    eager = (*ops.fused_add_rms_norm_fp8(x, res, w, 1e-5), *ops.silu_and_mul_fp8(gate_up))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = (*ops.fused_add_rms_norm_fp8(x, res, w, 1e-5), *ops.silu_and_mul_fp8(gate_up))
    graph.replay()
    torch.cuda.synchronize()
    _same_bits(out, eager)


def test_demo_model_same_tokens_and_logprobs_with_fusion_on_and_off(monkeypatch):
    from pagedserve import SamplingParams
    from pagedserve.entrypoints.llm import LLM
    from pagedserve.layers.quant.fusion import FUSE_ENV
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, prompt_logprobs=1)
    prompts = [{"prompt_token_ids": list(range(3, 3 + n))} for n in (5, 40, 130)]
    got = {}
    for fuse in ("1", "0"):
        monkeypatch.setenv(FUSE_ENV, fuse)
        llm = LLM(str(DEMO), dtype="bfloat16", quantization="fp8", num_gpu_blocks_override=512)
        outs = llm.generate(prompts, params)
        got[fuse] = [(list(o.outputs[0].token_ids), o.prompt_logprobs) for o in outs]
        llm.shutdown()
    assert got["1"] == got["0"]
