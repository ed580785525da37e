"""The Triton W8A8 GEMM on CUDA (skipped without an FP8 GPU; the H200 run records it): against the
dequantized product and cuBLASLt at Llama-3.1-8B's shapes (with and without split-K), inside a CUDA
graph, and the demo model's FP8 greedy tokens with PAGEDSERVE_FP8_GEMM=triton and auto against
cuBLASLt, with no Triton compile after start-up."""
import gc
from pathlib import Path

import pytest
import torch

from pagedserve.layers.quant import fp8_ops
from pagedserve.layers.quant import triton_fp8_gemm as gemm
from pagedserve.layers.quant.triton_fp8_gemm import triton_fp8_gemm

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or
                                not fp8_ops.scaled_mm_supported(torch.device("cuda")),
                                reason="needs a CUDA GPU with FP8")
DEMO = Path(__file__).resolve().parents[2] / "pagedserve" / "demo_model"
SPLIT8 = dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=128, GROUP_M=1, SPLIT_K=8, num_warps=4, num_stages=4)


def _operands(M, K, N, seed):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(M, K, device="cuda", generator=gen, dtype=torch.bfloat16)
    w = torch.randn(N, K, device="cuda", generator=gen, dtype=torch.bfloat16) * 0.02
    return (*fp8_ops.quantize_per_token(x), *fp8_ops.quantize_per_channel(w))


@pytest.mark.parametrize("config", [None, SPLIT8], ids=["chosen", "split8"])
@pytest.mark.parametrize("M,K,N", [(1, 4096, 6144), (5, 14336, 4096), (37, 4096, 28672), (64, 4096, 4096),
                                   (256, 14336, 4096), (1000, 4096, 4096)])
def test_triton_gemm_matches_dequantized_product_and_cublaslt(M, K, N, config):
    xq, xs, wq, ws = _operands(M, K, N, M)
    want = fp8_ops.dequantize(xq, xs) @ fp8_ops.dequantize(wq, ws[:, None]).t()
    y = triton_fp8_gemm(xq, xs, wq, ws, torch.bfloat16, config=config)
    assert y.dtype == torch.bfloat16
    # Both accumulate exact fp8 products in float32; the output's one bf16 rounding dominates.
    torch.testing.assert_close(y.float(), want, rtol=2 ** -7, atol=2 ** -7 * want.abs().max().item())
    cublas = torch._scaled_mm(xq, wq.t(), scale_a=xs, scale_b=ws.view(1, -1), out_dtype=torch.bfloat16)
    torch.testing.assert_close(y.float(), cublas.float(), rtol=2 ** -7, atol=2 ** -7 * want.abs().max().item())


@pytest.mark.parametrize("config", [None, SPLIT8], ids=["chosen", "split8"])
def test_triton_gemm_replays_in_a_cuda_graph(config):
    """The captured GEMM (split-K: two kernels and a partials buffer from the graph's pool) reads
    new inputs copied into its buffers on replay. Per-token scaling is scale-invariant, so the new
    input is a different draw, not a multiple of the old."""
    xq, xs, wq, ws = _operands(16, 4096, 4096, 0)
    xq2, xs2, _, _ = _operands(16, 4096, 4096, 1)
    eager2 = triton_fp8_gemm(xq2, xs2, wq, ws, config=config)
    triton_fp8_gemm(xq, xs, wq, ws, config=config)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = triton_fp8_gemm(xq, xs, wq, ws, config=config)
    graph.replay()
    torch.cuda.synchronize()
    first = out.clone()
    xq.copy_(xq2)
    xs.copy_(xs2)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager2) and not torch.equal(out, first)


def _compiled() -> int:
    return sum(len(entry[0]) for fn in (gemm.fp8_gemm_kernel, gemm.splitk_reduce_kernel)
               for entry in fn.device_caches.values())


def test_demo_model_greedy_tokens_with_triton_and_auto(monkeypatch):
    """The same first greedy tokens under cublas, triton (eager) and auto (CUDA graphs), and under
    triton and auto no GEMM compiles after start-up (the warm-up ran every config bucket)."""
    from pagedserve import LLM, SamplingParams
    prompts = ["In the beginning God created", "And the LORD spake unto Moses, saying",
               " ".join(["and it came to pass"] * 13), "Blessed"]
    params = SamplingParams(temperature=0.0, max_tokens=24)
    outs = {}
    for mode, eager in (("cublas", True), ("triton", True), ("auto", False)):
        monkeypatch.setattr(fp8_ops, "_GEMM_MODE", mode)
        llm = LLM(str(DEMO), quantization="fp8", dtype="bfloat16", enforce_eager=eager, gpu_memory_utilization=0.2)
        before = _compiled()
        outs[mode] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        if mode != "cublas":
            assert before > 0 and _compiled() == before, (mode, before, _compiled())
        llm.shutdown()
        del llm
        gc.collect()
        torch.cuda.empty_cache()
    # Same fp8 operands, float32 accumulation either way: only accumulation order differs, which can
    # flip a near-tie; the first tokens must agree.
    for mode in ("triton", "auto"):
        assert all(a[:8] == b[:8] for a, b in zip(outs["cublas"], outs[mode])), (mode, outs)
