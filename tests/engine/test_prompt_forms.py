"""The prompt forms both front ends accept (text, token ids, a dict of either) and the ValueErrors
for the rest: split_prompt, shared by the offline InputProcessor and the API process's engine."""
from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from pagedserve.core.config import CacheConfig
from pagedserve.demo_model import DEMO_MODEL_DIR
from pagedserve.engine.input_processor import InputProcessor, split_prompt


def test_forms():
    assert split_prompt("hi there", can_tokenize=True) == ("hi there", None)
    assert split_prompt([3, 4], can_tokenize=False) == (None, [3, 4])
    assert split_prompt((3, 4), can_tokenize=False) == (None, [3, 4])
    assert split_prompt({"prompt_token_ids": [5], "prompt": "x"}, can_tokenize=False) == ("x", [5])
    assert split_prompt({"prompt": "hi"}, can_tokenize=True) == ("hi", None)
    assert split_prompt({"prompt": [7]}, can_tokenize=False) == (None, [7])
    assert split_prompt({"prompt": "hi", "cache_salt": "s"}, can_tokenize=True) == ("hi", None)


@pytest.mark.parametrize("prompt, can_tokenize, message", [
    ({}, True, "prompt dict must hold"),
    ("", True, "prompt must not be empty"),
    ("hi", False, "skip_tokenizer_init=True"),
    ({"prompt": "hi"}, False, "skip_tokenizer_init=True"),
    ("hi".encode(), True, "list of integers"),
    ([1, 2.0], True, "list of integers"),
    ([True, 1], True, "list of integers"),
    ({"prompt_token_ids": "12"}, True, "list of integers"),
    (None, True, "prompt must be a string, a list of integers"),
    (5, True, "prompt must be a string, a list of integers"),
    ({"prompt_token_ids": [5], "prompt": 5}, True, "prompt .beside prompt_token_ids. must be a string"),
    ({"prompt": "hi", "multi_modal_data": {}}, True, "'multi_modal_data' is not supported"),
    ({"prompt_token_ids": [5], "cache_sal": "x"}, True, "unknown key 'cache_sal'"),
])
def test_refusals(prompt, can_tokenize, message):
    with pytest.raises(ValueError, match=message):
        split_prompt(prompt, can_tokenize)


def test_input_processor_tokenizes_text_and_refuses_no_ids():
    tok = AutoTokenizer.from_pretrained(str(DEMO_MODEL_DIR))
    proc = InputProcessor(tok, vocab_size=len(tok), max_model_len=64, max_num_seqs=4,
                          cache_config=CacheConfig(block_size=16))
    assert proc.prompt_ids("In the beginning") == ("In the beginning", tok.encode("In the beginning"))
    assert proc.prompt_ids({"prompt": "Let there be"}) == ("Let there be", tok.encode("Let there be"))
    with pytest.raises(ValueError, match=r"prompt_token_ids is \[\]"):
        proc.prompt_ids([])
    with pytest.raises(ValueError, match=r"prompt_token_ids is \[\]"):
        proc.prompt_ids({"prompt_token_ids": []})
