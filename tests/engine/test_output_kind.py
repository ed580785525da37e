"""RequestOutputKind: per-step (streaming) outputs versus one final output per request."""
import dataclasses

import pytest

from pagedserve import RequestOutputKind, SamplingParams

from .helpers import assert_no_leak, hf_greedy, make_llm, prompt_ids

N = 12


def test_final_only_outputs_once_and_equals_the_cumulative_stream(tiny_model_dir):
    model_dir = tiny_model_dir("llama")
    llm = make_llm(model_dir, block_size=4)
    engine = llm.llm_engine
    prompts = prompt_ids(model_dir)[:3]
    stream = SamplingParams(temperature=0.0, max_tokens=N, ignore_eos=True, stop=["the"])
    final = dataclasses.replace(stream, output_kind=RequestOutputKind.FINAL_ONLY)
    for i, p in enumerate(prompts):
        engine.add_request(f"s{i}", {"prompt_token_ids": p}, stream)
        engine.add_request(f"f{i}", {"prompt_token_ids": p}, final)
    seen: dict[str, list] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            seen.setdefault(out.request_id, []).append(out)
    for i, p in enumerate(prompts):
        s, f = seen[f"s{i}"], seen[f"f{i}"]
        # The stream reports every step it advanced, growing by one token, and finishes last.
        assert [len(o.outputs[0].token_ids) for o in s] == list(range(1, len(s) + 1))
        assert [o.finished for o in s] == [False] * (len(s) - 1) + [True]
        # The final-only request reports exactly once, when finished, with the same result.
        assert len(f) == 1 and f[0].finished
        assert f[0].outputs[0] == s[-1].outputs[0]
        assert f[0].outputs[0].token_ids == hf_greedy(model_dir, p, N, ignore_eos=True)[:len(s)]
    assert_no_leak(llm)


def test_generate_leaves_the_callers_params_alone(tiny_model_dir):
    model_dir = tiny_model_dir("llama")
    llm = make_llm(model_dir)
    params = SamplingParams(temperature=0.0, max_tokens=4)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompt_ids(model_dir)[:2]], params, use_tqdm=False)
    assert params.output_kind is RequestOutputKind.CUMULATIVE
    assert all(o.finished and len(o.outputs[0].token_ids) >= 1 for o in outs)


def test_output_kind_must_be_the_enum():
    with pytest.raises(ValueError, match="output_kind"):
        SamplingParams(output_kind="final_only")
