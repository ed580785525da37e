"""vLLM's repetition_detection: a sequence finishes ("repetition", stop_reason
"repetition_detected") at the first token where its output ends in a pattern of allowed size
repeated min_count times. The check against a brute-force reference over every short sequence,
then the engine against its own unconstrained greedy output cut where the reference says, on
both of the output processor's paths (with a tokenizer, and the token-only core's plain rows)."""
from __future__ import annotations

import itertools

import pytest

from pagedserve import SamplingParams
from pagedserve.engine.repetition import ends_in_repetition
from pagedserve.sampling_params import RepetitionDetectionParams

from .helpers import assert_no_leak, make_llm, prompt_ids

N = 24


def reference(output: list[int], lo: int, hi: int, count: int) -> bool:
    """Some k in [max(lo, 1), hi]: the last k * count tokens are the last k, count times over."""
    return any(k * count <= len(output) and output[len(output) - k * count:] == output[len(output) - k:] * count
               for k in range(max(lo, 1), hi + 1))


def test_the_check_against_brute_force():
    for n in range(0, 9):
        for output in itertools.product(range(3), repeat=n):
            out = list(output)
            for lo, hi, count in ((0, 1, 2), (0, 3, 2), (2, 3, 2), (1, 2, 3), (0, 4, 3), (3, 3, 2)):
                got = ends_in_repetition(out, RepetitionDetectionParams(hi, lo, count))
                assert got == reference(out, lo, hi, count), (out, lo, hi, count)
    assert not ends_in_repetition([5, 5, 5], RepetitionDetectionParams())  # max_pattern_size 0: off


@pytest.mark.parametrize("bad", [dict(max_pattern_size=2, min_count=1), dict(max_pattern_size=1, min_pattern_size=2),
                                 dict(max_pattern_size=-1), dict(max_pattern_size=2.5, min_count=2)])
def test_bad_params_are_refused(bad):
    with pytest.raises((ValueError, TypeError), match="repetition_detection"):
        SamplingParams(repetition_detection=bad)


def first_repetition(output: list[int], lo: int, hi: int, count: int, min_tokens: int) -> int | None:
    return next((t for t in range(max(min_tokens, 1), len(output) + 1)
                 if reference(output[:t], lo, hi, count)), None)


@pytest.mark.parametrize("skip_tokenizer", [False, True])
def test_the_engine_stops_where_the_reference_says(tiny_model_dir, skip_tokenizer):
    model_dir = tiny_model_dir("llama")
    llm = make_llm(model_dir, block_size=8, skip_tokenizer_init=skip_tokenizer)
    prompts = [{"prompt_token_ids": p} for p in prompt_ids(model_dir)]
    base = [o.outputs[0].token_ids for o in llm.generate(
        prompts, SamplingParams(temperature=0.0, max_tokens=N, ignore_eos=True, detokenize=not skip_tokenizer),
        use_tqdm=False)]
    cut = 0
    for lo, hi, count, min_tokens in ((0, 3, 2, 0), (0, 4, 2, 6), (1, 2, 3, 0)):
        rd = RepetitionDetectionParams(max_pattern_size=hi, min_pattern_size=lo, min_count=count)
        outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=N, ignore_eos=True,
                                                    min_tokens=min_tokens, repetition_detection=rd,
                                                    detokenize=not skip_tokenizer), use_tqdm=False)
        for ref, out in zip(base, outs):
            c = out.outputs[0]
            stop = first_repetition(ref, lo, hi, count, min_tokens)
            if stop is None:
                assert (c.token_ids, c.finish_reason, c.stop_reason) == (ref, "length", None)
            else:
                cut += 1
                assert (c.token_ids, c.finish_reason, c.stop_reason) == (ref[:stop], "repetition", "repetition_detected")
    assert cut > 0  # (the tiny model's greedy text repeats itself: the rule was met, not only missed)
    assert_no_leak(llm)
