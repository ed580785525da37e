"""step(final_only=True): one output per request, when it finishes, equal to the per-step stream's last."""
from pagedserve import SamplingParams

from .helpers import assert_no_leak, hf_greedy, make_llm, prompt_ids

N = 12


def _run(engine, prompts, params, final_only):
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", {"prompt_token_ids": p}, params)
    seen: dict[str, list] = {}
    while engine.has_unfinished_requests():
        for out in engine.step(final_only=final_only):
            seen.setdefault(out.request_id, []).append(out)
    return seen


def test_final_only_outputs_once_and_equals_the_stream(tiny_model_dir):
    model_dir = tiny_model_dir("llama")
    # No prefix caching: the second run then computes exactly what the first did.
    llm = make_llm(model_dir, block_size=4, enable_prefix_caching=False)
    prompts = prompt_ids(model_dir)[:3]
    params = SamplingParams(temperature=0.0, max_tokens=N, ignore_eos=True, stop=["the"])
    stream = _run(llm.llm_engine, prompts, params, final_only=False)
    final = _run(llm.llm_engine, prompts, params, final_only=True)
    for i, p in enumerate(prompts):
        s, f = stream[f"r{i}"], final[f"r{i}"]
        # The stream reports every step it advanced, growing by one token, and finishes last.
        assert [len(o.outputs[0].token_ids) for o in s] == list(range(1, len(s) + 1))
        assert [o.finished for o in s] == [False] * (len(s) - 1) + [True]
        # final_only reports exactly once, when finished, with the same result.
        assert len(f) == 1 and f[0].finished
        assert f[0].outputs[0] == s[-1].outputs[0]
        assert f[0].outputs[0].token_ids == hf_greedy(model_dir, p, N, ignore_eos=True)[:len(s)]
    assert_no_leak(llm)
