"""spaces_between_special_tokens=False as vLLM 0.26 honours it with a fast tokenizer: its
FastIncrementalDetokenizer decodes with tokenizers' DecodeStream and gives an added token that
follows an added output token its bare content (only with skip_special_tokens=False). The
reference below is that rule over the real DecodeStream; a WordPiece decoder puts spaces between
added tokens, so the flag shows there (a byte-level one puts none, in vLLM as here)."""
import random

import pytest

from pagedserve import SamplingParams
from pagedserve.engine.detokenizer import added_token_contents, detokenize_incrementally, initial_state

from detok_reference import vllm_fast_text, wordpiece_model, wordpiece_tokenizer

from .helpers import make_llm


def _stream(tok, prompt, out, skip, spaces):
    state, text = initial_state(len(prompt)), ""
    added = added_token_contents(tok)
    for i in range(1, len(out) + 1):
        new, state = detokenize_incrementally(tok, prompt, out[:i], state, skip,
                                              spaces_between_special_tokens=spaces, added=added)
        text += new
    new, _ = detokenize_incrementally(tok, prompt, out, state, skip, final=True,
                                      spaces_between_special_tokens=spaces, added=added)
    return text + new


def _chunked(tok, prompt, out, skip, spaces):
    """The server's path without stop strings: all new tokens in one call."""
    new, _ = detokenize_incrementally(tok, prompt, out, initial_state(len(prompt)), skip, final=True,
                                      spaces_between_special_tokens=spaces, added=added_token_contents(tok))
    return new


@pytest.mark.parametrize("spaces", [True, False])
@pytest.mark.parametrize("skip", [True, False])
def test_wordpiece_matches_vllms_fast_detokenizer(skip, spaces):
    tok = wordpiece_tokenizer()
    rng = random.Random(0)
    ids = list(range(1, 9))
    differs = False
    for _ in range(200):
        prompt = [rng.choice(ids) for _ in range(rng.randint(1, 4))]
        out = [rng.choice(ids) for _ in range(rng.randint(1, 8))]
        want = vllm_fast_text(tok, prompt, out, skip, spaces)
        assert _stream(tok, prompt, out, skip, spaces) == want, (prompt, out)
        assert _chunked(tok, prompt, out, skip, spaces) == want, (prompt, out)
        differs |= want != vllm_fast_text(tok, prompt, out, skip, True)
    assert differs == (not skip and not spaces)  # the flag shows only without skipping


def test_byte_level_tokenizer_matches_vllm(tiny_model_dir):
    from .helpers import tokenizer
    tok = tokenizer(str(tiny_model_dir("llama")))
    rng = random.Random(1)
    # whole characters only: how a stream shows a broken UTF-8 sequence is not this flag's business
    normal = tok.encode("hello world, a test")
    for _ in range(100):
        prompt = normal[:rng.randint(1, len(normal))]
        out = [rng.choice(normal + [0, 1, 2]) for _ in range(rng.randint(1, 8))]
        for spaces in (True, False):
            want = vllm_fast_text(tok, prompt, out, False, spaces)
            assert _stream(tok, prompt, out, False, spaces) == want == _chunked(tok, prompt, out, False, spaces)


@pytest.fixture(scope="module")
def wordpiece_model_dir(tiny_model_dir, tmp_path_factory):
    return wordpiece_model(tiny_model_dir("llama"), tmp_path_factory.mktemp("wordpiece-model"))


def test_llm_text_without_spaces_between_added_tokens(wordpiece_model_dir):
    from .helpers import tokenizer
    tok = tokenizer(str(wordpiece_model_dir))
    llm = make_llm(wordpiece_model_dir)
    prompt = [3, 4]
    kw = dict(temperature=0.8, seed=7, max_tokens=10, ignore_eos=True, skip_special_tokens=False,
              allowed_token_ids=[1, 2, 4, 5, 8])
    on, off = llm.generate([{"prompt_token_ids": prompt}] * 2,
                           [SamplingParams(**kw), SamplingParams(**kw, spaces_between_special_tokens=False)])
    out = list(on.outputs[0].token_ids)
    assert list(off.outputs[0].token_ids) == out
    assert on.outputs[0].text == vllm_fast_text(tok, prompt, out, False, True)
    assert off.outputs[0].text == vllm_fast_text(tok, prompt, out, False, False)
    assert on.outputs[0].text != off.outputs[0].text, out  # the seed draws added tokens in a row
