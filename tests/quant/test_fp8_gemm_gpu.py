"""The Triton W8A8 GEMM on CUDA (skipped without an FP8 GPU; the H200 run records it): against the
dequantized product and cuBLASLt at Llama-3.1-8B's shapes, inside a CUDA graph, and the demo model's
FP8 greedy tokens with it in place of cuBLASLt (PAGEDSERVE_FP8_GEMM=triton)."""
from pathlib import Path

import pytest
import torch

from pagedserve.layers.quant import fp8_ops
from pagedserve.layers.quant.triton_fp8_gemm import triton_fp8_gemm

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or
                                not fp8_ops.scaled_mm_supported(torch.device("cuda")),
                                reason="needs a CUDA GPU with FP8")
DEMO = Path(__file__).resolve().parents[2] / "pagedserve" / "demo_model"


@pytest.mark.parametrize("M,K,N", [(1, 4096, 6144), (37, 4096, 28672), (256, 14336, 4096), (1000, 4096, 4096)])
def test_triton_gemm_matches_dequantized_product_and_cublaslt(M, K, N):
    gen = torch.Generator(device="cuda").manual_seed(M)
    x = torch.randn(M, K, device="cuda", generator=gen, dtype=torch.bfloat16)
    w = torch.randn(N, K, device="cuda", generator=gen, dtype=torch.bfloat16) * 0.02
    xq, xs = fp8_ops.quantize_per_token(x)
    wq, ws = fp8_ops.quantize_per_channel(w)
    want = fp8_ops.dequantize(xq, xs) @ fp8_ops.dequantize(wq, ws[:, None]).t()
    y = triton_fp8_gemm(xq, xs, wq, ws, torch.bfloat16)
    assert y.dtype == torch.bfloat16
    # Both accumulate exact fp8 products in float32; the output's one bf16 rounding dominates.
    torch.testing.assert_close(y.float(), want, rtol=2 ** -7, atol=2 ** -7 * want.abs().max().item())
    cublas = torch._scaled_mm(xq, wq.t(), scale_a=xs, scale_b=ws.view(1, -1), out_dtype=torch.bfloat16)
    torch.testing.assert_close(y.float(), cublas.float(), rtol=2 ** -7, atol=2 ** -7 * want.abs().max().item())


def test_triton_gemm_replays_in_a_cuda_graph():
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(16, 4096, device="cuda", generator=gen, dtype=torch.bfloat16)
    wq, ws = fp8_ops.quantize_per_channel(torch.randn(4096, 4096, device="cuda", generator=gen) * 0.02)
    xq, xs = fp8_ops.quantize_per_token(x)
    eager = triton_fp8_gemm(xq, xs, wq, ws)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = triton_fp8_gemm(xq, xs, wq, ws)
    xq.copy_(fp8_ops.quantize_per_token(2 * x)[0])  # new inputs, same buffers
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, triton_fp8_gemm(xq, xs, wq, ws)) and not torch.equal(out, eager)


def test_demo_model_greedy_tokens_with_the_triton_gemm(monkeypatch):
    from pagedserve import LLM, SamplingParams
    prompts = ["In the beginning God created", "And the LORD spake unto Moses, saying"]
    params = SamplingParams(temperature=0.0, max_tokens=24)
    outs = {}
    for triton in (False, True):
        monkeypatch.setattr(fp8_ops, "_TRITON_GEMM", triton)
        llm = LLM(str(DEMO), quantization="fp8", dtype="bfloat16", enforce_eager=True)
        outs[triton] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        llm.shutdown()
    # Same fp8 operands, float32 accumulation either way: only accumulation order differs, which can
    # flip a near-tie; the first tokens must agree.
    assert all(a[:8] == b[:8] for a, b in zip(outs[False], outs[True])), outs
