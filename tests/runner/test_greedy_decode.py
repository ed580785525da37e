"""A hand-driven greedy loop through the runner (chunked prefill, mixed steps, growing block tables)
reproduces HF generate(do_sample=False) token for token."""
import pytest

from paged_harness import HandDriver, hf_greedy, hf_model, make_runner
from tiny_models import ARCHS

PROMPTS = [list(range(40, 51)), [7, 8, 9, 10, 11], [300 - 3 * i for i in range(23)]]
NEW_TOKENS = 10
_HF_CACHE = {}


def _expected(model_dir, prompts):
    key = (str(model_dir), tuple(map(tuple, prompts)))
    if key not in _HF_CACHE:
        ref = hf_model(model_dir)
        _HF_CACHE[key] = [hf_greedy(ref, p, NEW_TOKENS) for p in prompts]
    return _HF_CACHE[key]


def run_scenario(model_dir, block_size):
    runner = make_runner(model_dir, block_size=block_size, num_blocks=256)
    d = HandDriver(runner, seed=block_size)
    a, b, c = (d.add(p) for p in PROMPTS)
    # Step 1: all of A's prompt, the first chunk of C (does not sample).
    logits = d.step([d.schedule(a), d.schedule(c, 10)])
    assert logits.shape[0] == 1
    # Step 2: a decode of A, then the whole prompt of B and the rest of C, in one forward.
    d.step([d.schedule(a), d.schedule(b), d.schedule(c)])
    assert len(a.output_token_ids) == 2 and len(b.output_token_ids) == 1 and len(c.output_token_ids) == 1
    while any(len(s.output_token_ids) < NEW_TOKENS for s in (a, b, c)):
        d.step([d.schedule(s) for s in (a, b, c) if len(s.output_token_ids) < NEW_TOKENS])
    return [s.output_token_ids for s in (a, b, c)]


@pytest.mark.parametrize("arch,block_size", [(a, 16) for a in ARCHS] + [("llama", 1), ("llama", 8), ("llama", 32),
                                                                           ("qwen3", 1), ("opt", 8)])
def test_greedy_matches_hf_generate(tiny_model_dir, arch, block_size):
    model_dir = tiny_model_dir(arch)
    expected = _expected(model_dir, PROMPTS)
    got = run_scenario(model_dir, block_size)
    for g, e in zip(got, expected):
        assert len(e) >= 3, "HF stopped at EOS almost at once; pick other prompts"
        assert g[:len(e)] == e
