"""truncate_prompt_tokens through the server, on the demo model, whose tokenizer adds a BOS and
whose chat template writes one: a text prompt keeps the BOS and its last N - 1 tokens (HF's own
left truncation is the reference, as vLLM's renderer calls it), token ids and a chat's rendered
prompt keep their last N ids. The bound is vLLM's server's: max_model_len - max_tokens."""
from __future__ import annotations

import pytest

MAX_MODEL_LEN = 1024  # tools_server's
TEXT = ("Once upon a time there was a little fox who lived in the forest and liked to read "
        "books about the stars")


@pytest.fixture(scope="module")
def hf_tok(tools_model_dir):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(tools_model_dir, truncation_side="left")


def ran_ids(choice) -> list[int]:
    """The prompt's ids after the first, read off prompt_logprobs=0 (each position: its own token)."""
    lps = choice["prompt_logprobs"]
    assert lps[0] is None and all(len(d) == 1 for d in lps[1:]), lps
    return [int(next(iter(d))) for d in lps[1:]]


def complete(http, **body):
    body = {"model": "tiny", "max_tokens": 4, "temperature": 0, "ignore_eos": True, "prompt_logprobs": 0, **body}
    return http.post("/v1/completions", json=body)


def test_text_prompt_keeps_the_bos(tools_http, hf_tok):
    keep = 7
    want = hf_tok(TEXT, truncation=True, max_length=keep).input_ids
    full = hf_tok(TEXT).input_ids
    assert want[0] == hf_tok.bos_token_id and want != full[-keep:]
    r = complete(tools_http, prompt=TEXT, truncate_prompt_tokens=keep, echo=True).json()
    assert r["usage"]["prompt_tokens"] == keep and ran_ids(r["choices"][0]) == want[1:]
    # The same ids given as the prompt run the same (their echo: the same text, then the same tokens).
    same = complete(tools_http, prompt=want, echo=True).json()
    assert r["choices"][0]["text"] == same["choices"][0]["text"]
    # Given as token ids, the prompt keeps its last ids, BOS gone.
    r = complete(tools_http, prompt=full, truncate_prompt_tokens=keep).json()
    assert r["usage"]["prompt_tokens"] == keep and ran_ids(r["choices"][0]) == full[-keep + 1:]


def test_chat_keeps_the_last_ids_of_the_rendered_prompt(tools_http, hf_tok):
    keep = 9
    messages = [{"role": "user", "content": TEXT}]
    # tools_model_dir's tokenizer holds the server's --chat-template: HF's rendering is the reference
    rendered = hf_tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    want = hf_tok(rendered, add_special_tokens=False, truncation=True, max_length=keep).input_ids
    whole = hf_tok(rendered, add_special_tokens=False).input_ids
    assert whole[0] == hf_tok.bos_token_id and want == whole[-keep:]
    r = tools_http.post("/v1/chat/completions", json={
        "model": "tiny", "messages": messages, "max_tokens": 2, "temperature": 0, "prompt_logprobs": 0,
        "truncate_prompt_tokens": keep}).json()
    assert r["usage"]["prompt_tokens"] == keep and ran_ids(r) == want[1:]


def test_the_bound_is_max_model_len_minus_max_tokens(tools_http):
    """vLLM's server keeps at most max_model_len - max_tokens (16 when unset for completions, 0
    for chat): -1 keeps that many, more is a 400 naming the field, whatever the prompt's length."""
    long_ids = [5 + i % 300 for i in range(MAX_MODEL_LEN + 50)]
    r = complete(tools_http, prompt=long_ids, truncate_prompt_tokens=-1, prompt_logprobs=None).json()
    assert r["usage"]["prompt_tokens"] == MAX_MODEL_LEN - 4
    bad = complete(tools_http, prompt=[5, 6, 7], truncate_prompt_tokens=MAX_MODEL_LEN - 3)
    assert bad.status_code == 400, bad.text
    err = bad.json()["error"]
    assert err["param"] == "truncate_prompt_tokens"
    assert f"must be <= max_model_len - max_tokens ({MAX_MODEL_LEN - 4})" in err["message"]
    unset = {"model": "tiny", "prompt": [5, 6, 7], "truncate_prompt_tokens": MAX_MODEL_LEN - 15}
    assert tools_http.post("/v1/completions", json=unset).status_code == 400
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 5,
            "truncate_prompt_tokens": MAX_MODEL_LEN - 4}
    bad = tools_http.post("/v1/chat/completions", json=chat)
    assert bad.status_code == 400 and "max_model_len - max_completion_tokens (1019)" in bad.json()["error"]["message"]
    ok = tools_http.post("/v1/chat/completions", json={**chat, "truncate_prompt_tokens": MAX_MODEL_LEN - 5})
    assert ok.status_code == 200, ok.text
    zero = tools_http.post("/v1/chat/completions", json={**chat, "truncate_prompt_tokens": 0})
    assert zero.status_code == 400 and zero.json()["error"]["param"] == "truncate_prompt_tokens"
