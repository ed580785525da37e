"""SamplingParams.truncate_prompt_tokens (vLLM's): the engine keeps N of the prompt's tokens
(-1: max_model_len of them) before its length checks, offline (LLM.generate, LLM.chat) and through
AsyncLLMEngine; outputs report the cut prompt as their prompt_token_ids, as vLLM's do. Token ids
keep their last N; text is cut by the tokenizer's own left truncation, which keeps the special
tokens it adds (a BOS: the demo model's tokenizer adds one, HF's tokenizer is the reference). The
server cuts in its own front end with the same function and leaves the field unset (tests/server
cover it)."""
from __future__ import annotations

import asyncio

import pytest

from pagedserve.config import EngineConfig
from pagedserve.demo_model import DEMO_MODEL_DIR
from pagedserve.engine.async_engine import AsyncLLMEngine
from pagedserve.engine.input_processor import truncated_prompt, truncation_size
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


def test_cut_keeps_the_last_ids():
    ids = list(range(10))
    assert truncated_prompt(None, ids, None, 64) == (ids, False)
    assert truncated_prompt(None, ids, 3, 64) == ([7, 8, 9], True)
    assert truncated_prompt(None, ids, 10, 64) == (ids, False)
    assert truncated_prompt(None, ids, 64, 64) == (ids, False)
    assert truncated_prompt(None, ids, -1, 4) == ([6, 7, 8, 9], True)
    assert truncated_prompt(None, truncated_prompt(None, ids, 3, 64)[0], 3, 64) == ([7, 8, 9], False)  # idempotent
    with pytest.raises(ValueError, match=r"truncate_prompt_tokens \(65\) must be <= max_model_len \(64\)"):
        truncated_prompt(None, ids, 65, 64)


def test_truncation_size_reads_vllms_values():
    assert truncation_size(None, 64) is None
    assert truncation_size(5, 64) == 5 and truncation_size(64, 64) == 64
    assert truncation_size(-1, 48) == 48
    assert truncation_size(-1, None) is None and truncation_size(10**6, None) == 10**6  # the router: no bound known
    with pytest.raises(ValueError, match=r"truncate_prompt_tokens \(49\) must be <= max_model_len - max_tokens \(48\)"):
        truncation_size(49, 48, "max_model_len - max_tokens")
    for bad in (0, -2):
        with pytest.raises(ValueError, match="truncate_prompt_tokens must be >= 1, or -1"):
            truncation_size(bad, 64)
    with pytest.raises(ValueError, match="keeps max_model_len - max_tokens \\(0\\) tokens: none"):
        truncation_size(-1, 0, "max_model_len - max_tokens")


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


def async_generate(model_dir, text: str, keep: int, then=None):
    """The last output of `text` under truncate_prompt_tokens=keep from an AsyncLLMEngine (a
    core process of its own), with prompt logprobs; then(engine) runs before it shuts down."""
    engine = AsyncLLMEngine.from_engine_config(EngineConfig(
        model=str(model_dir), device="cpu", dtype="float32", swap_space=0.01, num_gpu_blocks_override=512,
        block_size=8, max_model_len=MAX_MODEL_LEN))

    async def go():
        try:
            params = SamplingParams(truncate_prompt_tokens=keep, prompt_logprobs=0, **GREEDY)
            last = [o async for o in engine.generate(text, params, "cut")][-1]
            if then is not None:
                await then(engine)
            return last
        finally:
            await engine.shutdown()
    return asyncio.run(go())


def test_async_engine_cuts_and_reports_the_cut_prompt(llm, model_dir):
    tok = tokenizer(str(model_dir))
    text = PROMPT_TEXTS[7]
    ids = tok.encode(text)
    keep = 7
    want = llm.generate([ids[-keep:]], SamplingParams(**GREEDY), use_tqdm=False)[0]

    async def too_many(engine):
        with pytest.raises(ValueError, match=r"truncate_prompt_tokens \(65\) must be <= max_model_len"):
            await engine.add_request("too-many", text, SamplingParams(truncate_prompt_tokens=65))
    got = async_generate(model_dir, text, keep, then=too_many)
    assert got.prompt_token_ids == ids[-keep:]
    assert len(got.prompt_logprobs) == keep  # the prompt that ran, position by position
    assert got.outputs[0].token_ids == want.outputs[0].token_ids


# ---- a tokenizer that adds a BOS: the demo model's --------------------------------------------

@pytest.fixture(scope="module")
def demo_llm():
    return make_llm(DEMO_MODEL_DIR, max_model_len=MAX_MODEL_LEN, block_size=8)


def hf_left(text: str, keep: int, add_special_tokens: bool = True) -> list[int]:
    """HF's own left truncation: what vLLM's renderer keeps of a text prompt."""
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(DEMO_MODEL_DIR, truncation_side="left")
    return tok(text, truncation=True, max_length=keep, add_special_tokens=add_special_tokens).input_ids


def test_text_keeps_the_bos_the_tokenizer_adds():
    """A tokenizer loaded elsewhere cuts on the right (transformers' default): the cut is still
    the left one, and the tokenizer is left as it was."""
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(DEMO_MODEL_DIR)
    text = PROMPT_TEXTS[7]
    full = tok(text).input_ids
    assert full[0] == tok.bos_token_id and tok.truncation_side == "right"
    for keep in (1, 2, 7, len(full) - 1):
        want = hf_left(text, keep)
        assert want[0] == tok.bos_token_id and len(want) == keep
        assert truncated_prompt(tok, text, keep, MAX_MODEL_LEN) == (want, True)
    assert hf_left(text, 7) != full[-7:]  # not the last 7 ids: the BOS stays
    assert truncated_prompt(tok, text, len(full), MAX_MODEL_LEN) == (full, False)
    assert truncated_prompt(tok, full, 7, MAX_MODEL_LEN) == (full[-7:], True)  # ids: their last 7
    assert tok.truncation_side == "right"


def test_generate_keeps_the_bos_of_a_text_prompt(demo_llm):
    text = PROMPT_TEXTS[7]
    keep = 7
    want_ids = hf_left(text, keep)
    want = demo_llm.generate([want_ids], SamplingParams(**GREEDY), use_tqdm=False)[0]
    got = demo_llm.generate([text], SamplingParams(truncate_prompt_tokens=keep, **GREEDY), use_tqdm=False)[0]
    assert got.prompt_token_ids == want_ids
    assert got.outputs[0].token_ids == want.outputs[0].token_ids
    # The same prompt as token ids keeps its last 7 ids, BOS or not (vLLM's tokens prompt).
    full = demo_llm.get_tokenizer()(text).input_ids
    out = demo_llm.generate([full], SamplingParams(truncate_prompt_tokens=keep, **GREEDY), use_tqdm=False)[0]
    assert out.prompt_token_ids == full[-keep:] != want_ids


def test_chat_keeps_the_last_ids_of_the_rendered_prompt(demo_llm):
    """The demo template writes the BOS as text; vLLM tokenizes the rendering without added
    special tokens and cuts that on the left: the last N ids, the BOS gone."""
    from transformers import AutoTokenizer
    conversation = [{"role": "user", "content": PROMPT_TEXTS[4]}]
    rendered = AutoTokenizer.from_pretrained(DEMO_MODEL_DIR).apply_chat_template(
        conversation, add_generation_prompt=True, tokenize=False)
    keep = 9
    want = hf_left(rendered, keep, add_special_tokens=False)
    got = demo_llm.chat(conversation, SamplingParams(truncate_prompt_tokens=keep, **GREEDY), use_tqdm=False)[0]
    assert got.prompt_token_ids == want and want[0] != demo_llm.get_tokenizer().bos_token_id


def test_async_engine_keeps_the_bos_of_a_text_prompt(demo_llm):
    text = PROMPT_TEXTS[7]
    keep = 7
    want_ids = hf_left(text, keep)
    got = async_generate(DEMO_MODEL_DIR, text, keep)
    assert got.prompt_token_ids == want_ids and len(got.prompt_logprobs) == keep
