"""Our paged models give HF's logits for every prompt of a mixed-length batch, whatever the paging."""
import pytest
import torch

from pagedserve.core.plan import SchedulerOutput
from paged_harness import HandDriver, hf_model, make_runner
from tiny_models import ARCHS

PROMPTS = [[5, 17, 33, 101, 7], [9], list(range(3, 40)), [200, 201, 202, 203, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 90, 91, 92]]


def _check_full_prompts(model_dir, block_size):
    runner = make_runner(model_dir, block_size=block_size)
    driver = HandDriver(runner, seed=block_size)
    seqs = [driver.add(p) for p in PROMPTS]
    logits = driver.runner.execute(SchedulerOutput(scheduled=[driver.schedule(s) for s in seqs]))
    ref = hf_model(model_dir)
    with torch.no_grad():
        expected = torch.stack([ref(torch.tensor([p])).logits[0, -1] for p in PROMPTS])
    torch.testing.assert_close(logits, expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("arch", ARCHS)
def test_prompt_logits_match_hf(tiny_model_dir, arch):
    _check_full_prompts(tiny_model_dir(arch), block_size=4)


def test_prompt_logits_sharded_checkpoint(tiny_model_dir):
    _check_full_prompts(tiny_model_dir("llama", max_shard_size="20KB"), block_size=16)


def test_prompt_logits_tied_embeddings(tiny_model_dir):
    model_dir = tiny_model_dir("llama", tie_word_embeddings=True)
    runner = make_runner(model_dir)
    assert runner.model.lm_head.weight is runner.model.model.embed_tokens.weight
    _check_full_prompts(model_dir, block_size=8)
