"""SamplingParams(prompt_logprobs=k): every prompt token's logprob given the tokens before it, with
the top k, as HF computes them in one forward; across prefill chunks, beside a cached prefix it must
not reuse, and with k = 0 (the prompt tokens only)."""
import torch

from pagedserve import SamplingParams
from .helpers import hf_model, make_llm

PROMPT = [0] + [(7 * i + 3) % 300 + 3 for i in range(45)]


def _hf_logp(model_dir, ids):
    with torch.no_grad():
        return torch.log_softmax(hf_model(str(model_dir))(torch.tensor([ids])).logits[0].float(), -1)


def test_prompt_logprobs_match_hf_across_chunks_and_a_shared_prefix(tiny_model_dir):
    model_dir = tiny_model_dir("llama")
    # 16-token steps split the 46-token prompt into chunks; the prefix cache holds the first request's blocks
    llm = make_llm(model_dir, block_size=8, max_num_batched_tokens=16, max_num_seqs=4, async_scheduling=True)
    warm = llm.generate([{"prompt_token_ids": PROMPT}], SamplingParams(max_tokens=1))  # fills the prefix cache
    assert warm[0].prompt_logprobs is None
    hits = llm.get_kv_cache_stats().prefix_cache_hits
    outs = llm.generate([{"prompt_token_ids": PROMPT}, {"prompt_token_ids": PROMPT[:20]}],
                        [SamplingParams(max_tokens=2, prompt_logprobs=3),
                         SamplingParams(max_tokens=2, prompt_logprobs=0)])
    assert llm.get_kv_cache_stats().prefix_cache_hits == hits  # neither read the cached prefix
    ref = _hf_logp(model_dir, PROMPT)
    for out, k in zip(outs, (3, 0)):
        ids = out.prompt_token_ids
        lps = out.prompt_logprobs
        assert len(lps) == len(ids) and lps[0] is None
        for pos in range(1, len(ids)):
            entry, want = lps[pos], ref[pos - 1]
            assert abs(entry[ids[pos]].logprob - want[ids[pos]].item()) < 1e-4, (pos, entry, want[ids[pos]])
            top = set(want.topk(k).indices.tolist()) if k else set()
            assert set(entry) == top | {ids[pos]}, (pos, entry)
    llm.shutdown()
