"""N-gram speculation on CUDA (skipped without a GPU): verification rows replay the decode CUDA
graphs (runner/decode_rows.py) and greedy tokens equal HF's in float32, graphs on or off."""
import pytest
import torch

from pagedserve import SamplingParams
from tests.engine.helpers import assert_no_leak, hf_greedy, make_llm, tokenizer
from tests.spec_decode.test_spec_greedy import NGRAM, TEXTS

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.parametrize("enforce_eager", [True, False])
def test_cuda_spec_greedy_matches_hf(tiny_model_dir, enforce_eager):
    model_dir = tiny_model_dir("llama")
    tok = tokenizer(str(model_dir))
    ids = [tok.encode(t) for t in TEXTS]
    llm = make_llm(model_dir, device="cuda", enforce_eager=enforce_eager, max_num_seqs=16, speculative_config=NGRAM)
    runner = llm.llm_engine.runner
    paths = []
    execute = runner.execute

    def spy(out, *a, **kw):
        r = execute(out, *a, **kw)
        if out.num_lookahead_tokens:
            paths.append(runner.last_graph_path)
        return r
    runner.execute = spy
    outs = llm.generate([{"prompt_token_ids": p} for p in ids],
                        SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True), use_tqdm=False)
    for p, o in zip(ids, outs):
        assert o.outputs[0].token_ids == hf_greedy(model_dir, p, 24, ignore_eos=True)
    assert_no_leak(llm)
    assert paths and llm.get_spec_decode_stats().num_accepted_tokens > 0
    if not enforce_eager:
        assert "decode_rows" in paths, paths
