"""Full graphs on CUDA (cudagraph_mode="full"): the engine with long prompts chunked beside decodes
replays a full graph for every step with prefill tokens, and its greedy tokens equal the eager
engine's (float32: the unified kernel's dots are IEEE there, so a flip would be a bug, not
rounding). Skipped without CUDA; tests/runner/test_full_graphs.py is the CPU twin."""
import random

import pytest
import torch

from pagedserve import SamplingParams

from engine.helpers import make_llm

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_full_graph_engine_equals_eager(tiny_model_dir, arch):
    model_dir = tiny_model_dir(arch)
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 300) for _ in range(n)] for n in (450, 9, 250, 30, 5, 333, 120, 64)]
    params = [SamplingParams(temperature=0.0, max_tokens=rng.randrange(4, 16), ignore_eos=True) for _ in prompts]
    requests = [{"prompt_token_ids": p} for p in prompts]
    kw = dict(device="cuda", dtype="float32", max_num_seqs=8, max_num_batched_tokens=96, max_model_len=512)
    want = [o.outputs[0].token_ids for o in make_llm(model_dir, enforce_eager=True, **kw)
            .generate(requests, params, use_tqdm=False)]
    llm = make_llm(model_dir, cudagraph_mode="full", **kw)
    runner = llm.llm_engine.runner.runner
    assert runner.full_graphs is not None and runner.piecewise is None
    steps = []
    execute = runner.execute_model

    def traced(step, prev=None):
        out = execute(step, prev)
        if step.batch is not None:
            steps.append((step.batch.num_decodes, len(step.batch.query_lens), runner.last_graph_path))
        return out
    runner.execute_model = traced
    got = [o.outputs[0].token_ids for o in llm.generate(requests, params, use_tqdm=False)]
    assert got == want
    with_prefill = {p for nd, n, p in steps if nd < n}
    assert "full_graph" in with_prefill and with_prefill <= {"full_graph", "decode_rows"}
    assert sum(1 for nd, n, p in steps if 0 < nd < n and p == "full_graph") >= 3
