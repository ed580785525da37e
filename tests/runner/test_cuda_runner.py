"""The runner on CUDA in bfloat16 (skipped without a GPU): HF's logits within bf16 noise, and
KV-cache sizing by profiling leaves a pool that actually fits."""
import pytest
import torch

from pagedserve.config import EngineConfig
from pagedserve.core.plan import SchedulerOutput
from pagedserve.models.loader import load_hf_config
from pagedserve.runner.model_runner import ModelRunner
from paged_harness import HandDriver, hf_model
from tiny_models import ARCHS, MOE_ARCHS

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
PROMPTS = [[5, 17, 33, 101, 7], list(range(3, 40)), [9]]


def cuda_runner(model_dir, **kw):
    cfg = EngineConfig(model=str(model_dir), block_size=16, swap_space=0.01, **kw)
    runner = ModelRunner(cfg, load_hf_config(model_dir), torch.device("cuda"), torch.bfloat16)
    runner.load_model()
    return runner


@pytest.mark.parametrize("arch", [a for a in ARCHS if a not in MOE_ARCHS])
def test_bf16_prompt_logits_close_to_hf(tiny_model_dir, arch):
    model_dir = tiny_model_dir(arch)
    runner = cuda_runner(model_dir, num_gpu_blocks_override=64)
    runner.init_kv_cache(64, 4)
    d = HandDriver(runner, seed=0)
    seqs = [d.add(p) for p in PROMPTS]
    logits = runner.execute(SchedulerOutput(scheduled=[d.schedule(s) for s in seqs])).cpu()
    ref = hf_model(model_dir)
    with torch.no_grad():
        expected = torch.stack([ref(torch.tensor([p])).logits[0, -1] for p in PROMPTS])
    err = (logits - expected).abs().max() / expected.abs().max()
    assert err < 0.05, err
    assert (logits.argmax(-1) == expected.argmax(-1)).float().mean() >= 2 / 3


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_moe_bf16_prompt_logits_close_to_hf(tiny_model_dir, arch):
    """A mixture of experts in bf16 against HF in fp32, judged over many prompts: where a token's
    k-th and (k+1)-th experts score within bf16 noise, the two runs may route it differently and
    that prompt's logits differ by far more than rounding, so a max over three prompts (the dense
    test above) would be luck. Most prompts must agree on the argmax and the median error must be
    bf16-sized."""
    model_dir = tiny_model_dir(arch)
    runner = cuda_runner(model_dir, num_gpu_blocks_override=256)
    runner.init_kv_cache(256, 4)
    d = HandDriver(runner, seed=0)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 300, (int(n),), generator=g).tolist()
               for n in torch.randint(1, 60, (24,), generator=g)]
    seqs = [d.add(p) for p in prompts]
    logits = runner.execute(SchedulerOutput(scheduled=[d.schedule(s) for s in seqs])).float().cpu()
    ref = hf_model(model_dir)
    with torch.no_grad():
        expected = torch.stack([ref(torch.tensor([p])).logits[0, -1] for p in prompts])
    err = (logits - expected).abs().amax(-1) / expected.abs().amax(-1)
    assert err.median() < 0.03, err
    assert (logits.argmax(-1) == expected.argmax(-1)).float().mean() >= 0.8


def test_profiled_num_blocks_fit(tiny_model_dir):
    runner = cuda_runner(tiny_model_dir("llama"), gpu_memory_utilization=0.3, max_num_batched_tokens=2048)
    num_gpu, num_cpu = runner.determine_num_blocks()
    free, total = torch.cuda.mem_get_info()
    assert 0 < num_gpu * runner.block_bytes <= 0.3 * total
    runner.init_kv_cache(num_gpu, num_cpu)
    assert runner.cache_engine.cpu_pool.is_pinned()
    assert torch.cuda.memory_allocated() <= 0.3 * total + (total - free)
