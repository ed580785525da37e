"""SamplingParams.truncate_prompt_tokens (vLLM's): the engine keeps the prompt's last N tokens
(-1: max_model_len of them) before its length checks, offline (LLM.generate, LLM.chat) and through
AsyncLLMEngine; outputs report the cut prompt as their prompt_token_ids, as vLLM's do. The server
cuts in its own front end and leaves the field unset (tests/server cover it)."""
from __future__ import annotations

import asyncio

import pytest

from pagedserve.config import EngineConfig
from pagedserve.engine.async_engine import AsyncLLMEngine
from pagedserve.engine.input_processor import truncate_prompt_ids
from pagedserve.sampling_params import SamplingParams

from .helpers import PROMPT_TEXTS, make_llm, tokenizer

MAX_MODEL_LEN = 64
GREEDY = dict(temperature=0.0, max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir):
    return tiny_model_dir("llama")


@pytest.fixture(scope="module")
def llm(model_dir):
    return make_llm(model_dir, max_model_len=MAX_MODEL_LEN, block_size=8)


@pytest.mark.parametrize("bad", [0, -2, -100, True, 2.5])
def test_bad_values_are_refused_naming_the_field(bad):
    with pytest.raises(ValueError, match="truncate_prompt_tokens"):
        SamplingParams(truncate_prompt_tokens=bad)


def test_cut_keeps_the_last_tokens():
    ids = list(range(10))
    assert truncate_prompt_ids(ids, None, 64) == ids
    assert truncate_prompt_ids(ids, 3, 64) == [7, 8, 9]
    assert truncate_prompt_ids(ids, 10, 64) == ids
    assert truncate_prompt_ids(ids, 64, 64) == ids
    assert truncate_prompt_ids(ids, -1, 4) == [6, 7, 8, 9]
    assert truncate_prompt_ids(truncate_prompt_ids(ids, 3, 64), 3, 64) == [7, 8, 9]  # idempotent
    with pytest.raises(ValueError, match=r"truncate_prompt_tokens \(65\) must be <= max_model_len \(64\)"):
        truncate_prompt_ids(ids, 65, 64)


def test_generate_equals_generation_on_the_cut_prompt(llm, model_dir):
    tok = tokenizer(str(model_dir))
    text = PROMPT_TEXTS[7]
    ids = tok.encode(text)
    assert len(ids) > 12
    keep = 7
    want = llm.generate([{"prompt_token_ids": ids[-keep:]}], SamplingParams(**GREEDY), use_tqdm=False)[0]
    params = SamplingParams(truncate_prompt_tokens=keep, **GREEDY)
    for prompt in (text, ids, {"prompt_token_ids": ids}):
        got = llm.generate([prompt], params, use_tqdm=False)[0]
        assert got.prompt_token_ids == ids[-keep:]  # vLLM reports the prompt it ran
        assert got.outputs[0].token_ids == want.outputs[0].token_ids
    # A text prompt keeps its text as given (vLLM's RequestOutput.prompt), only the ids are cut.
    assert llm.generate([text], params, use_tqdm=False)[0].prompt == text
    # Longer than the prompt, or -1 with a prompt under max_model_len: nothing is cut.
    for keep_all in (len(ids), MAX_MODEL_LEN, -1):
        out = llm.generate([ids], SamplingParams(truncate_prompt_tokens=keep_all, **GREEDY), use_tqdm=False)[0]
        assert out.prompt_token_ids == ids


def test_truncation_comes_before_the_length_checks(llm, model_dir):
    long_ids = [5 + i % 50 for i in range(3 * MAX_MODEL_LEN)]
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate([long_ids], SamplingParams(**GREEDY), use_tqdm=False)
    out = llm.generate([long_ids], SamplingParams(truncate_prompt_tokens=20, **GREEDY), use_tqdm=False)[0]
    assert out.prompt_token_ids == long_ids[-20:] and len(out.outputs[0].token_ids) == 6
    # -1 keeps max_model_len tokens, which leaves no room for output: the engine's length error.
    with pytest.raises(ValueError, match=rf"prompt length \({MAX_MODEL_LEN} tokens\) must be < max_model_len"):
        llm.generate([long_ids], SamplingParams(truncate_prompt_tokens=-1, **GREEDY), use_tqdm=False)
    # More than max_model_len could never run: refused, as vLLM's _validate_truncation_size does.
    with pytest.raises(ValueError, match=rf"truncate_prompt_tokens \(65\) must be <= max_model_len \({MAX_MODEL_LEN}\)"):
        llm.generate([[5, 6, 7]], SamplingParams(truncate_prompt_tokens=65, **GREEDY), use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()


def test_chat_cuts_the_rendered_prompt(llm):
    conversation = [{"role": "system", "content": "Be brief."},
                    {"role": "user", "content": PROMPT_TEXTS[4]}]
    rendered = llm.chat(conversation, SamplingParams(temperature=0.0, max_tokens=1), use_tqdm=False)[0].prompt_token_ids
    keep = 9
    assert len(rendered) > keep
    got = llm.chat(conversation, SamplingParams(truncate_prompt_tokens=keep, **GREEDY), use_tqdm=False)[0]
    want = llm.generate([rendered[-keep:]], SamplingParams(**GREEDY), use_tqdm=False)[0]
    assert got.prompt_token_ids == rendered[-keep:]
    assert got.outputs[0].token_ids == want.outputs[0].token_ids


def test_async_engine_cuts_and_reports_the_cut_prompt(llm, model_dir):
    tok = tokenizer(str(model_dir))
    text = PROMPT_TEXTS[7]
    ids = tok.encode(text)
    keep = 7
    want = llm.generate([ids[-keep:]], SamplingParams(**GREEDY), use_tqdm=False)[0]
    engine = AsyncLLMEngine.from_engine_config(EngineConfig(
        model=str(model_dir), device="cpu", dtype="float32", swap_space=0.01, num_gpu_blocks_override=512,
        block_size=8, max_model_len=MAX_MODEL_LEN))

    async def go():
        try:
            params = SamplingParams(truncate_prompt_tokens=keep, prompt_logprobs=0, **GREEDY)
            outs = [o async for o in engine.generate(text, params, "cut")]
            with pytest.raises(ValueError, match=r"truncate_prompt_tokens \(65\) must be <= max_model_len"):
                await engine.add_request("too-many", text, SamplingParams(truncate_prompt_tokens=65))
            return outs[-1]
        finally:
            await engine.shutdown()
    got = asyncio.run(go())
    assert got.prompt_token_ids == ids[-keep:]
    assert len(got.prompt_logprobs) == keep  # the prompt that ran, position by position
    assert got.outputs[0].token_ids == want.outputs[0].token_ids
