"""The whole engine on CUDA (skipped without a GPU): Triton kernels, CUDA-graph decode,
pinned swaps. In float32 the tokens must equal HF's greedy ones, graphs on or off."""
import pytest
import torch

from pagedserve import SamplingParams
from .helpers import assert_no_leak, hf_greedy, make_llm, prompt_ids

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
MAX_NEW = 24


# The MoE families run the Triton routing and grouped GEMM, inside the decode graphs when not eager.
@pytest.mark.parametrize("arch", ["llama", "qwen3", "opt", "qwen3_moe", "qwen2_moe", "mixtral"])
@pytest.mark.parametrize("enforce_eager", [True, False])
def test_cuda_greedy_matches_hf(tiny_model_dir, arch, enforce_eager):
    model_dir = tiny_model_dir(arch)
    prompts = prompt_ids(model_dir)
    llm = make_llm(model_dir, device="cuda", enforce_eager=enforce_eager, max_num_seqs=16)
    if not enforce_eager:
        assert llm.llm_engine.runner.graphs is not None
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True), use_tqdm=False)
    for p, o in zip(prompts, outs):
        assert o.outputs[0].token_ids == hf_greedy(model_dir, p, MAX_NEW, ignore_eos=True)
    assert_no_leak(llm)


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_cuda_preemption_keeps_tokens(tiny_model_dir, mode):
    model_dir = tiny_model_dir("llama")
    prompts = prompt_ids(model_dir)
    llm = make_llm(model_dir, device="cuda", block_size=8, num_gpu_blocks_override=24, preemption_mode=mode,
                   swap_space=0.05, enable_prefix_caching=False)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True), use_tqdm=False)
    assert llm.get_kv_cache_stats().num_preemptions > 0
    for p, o in zip(prompts, outs):
        assert o.outputs[0].token_ids == hf_greedy(model_dir, p, MAX_NEW, ignore_eos=True)
    assert_no_leak(llm)


@pytest.mark.parametrize("enforce_eager", [True, False])
def test_cuda_overlap_on_and_off_token_exact(tiny_model_dir, enforce_eager):
    """Overlapped steps on the GPU (side-stream copies, placeholders filled on the device, CUDA
    graphs) give the tokens synchronous steps give, on the mixed workload of the CPU test."""
    from .test_async_scheduling import _run, _workload
    model_dir = tiny_model_dir("llama")
    ids = prompt_ids(model_dir)
    stops = [t[3] for t in (o.outputs[0].token_ids for o in make_llm(model_dir, device="cuda").generate(
        [{"prompt_token_ids": p} for p in ids], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True),
        use_tqdm=False))]
    reqs = _workload(ids, stops)
    finals = {}
    for on in (True, False):
        llm = make_llm(model_dir, device="cuda", enforce_eager=enforce_eager, block_size=4, num_gpu_blocks_override=40,
                       swap_space=0.05, max_num_batched_tokens=32, max_num_seqs=16, async_scheduling=on)
        finals[on] = _run(llm, reqs)[0]
    survivors = {r[1] for r in reqs} - {"victim1", "victim4"}
    for rid in survivors:
        assert finals[True][rid] == finals[False][rid], rid
