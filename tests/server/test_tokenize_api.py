"""/tokenize, /detokenize and /version (vLLM's extras, serving_tokenize.py) against HF's own
tokenizer and chat template; bad input is a 400 naming its field."""
from __future__ import annotations

import pytest
from transformers import AutoTokenizer

TEXT = "In the beginning God created the heaven and the earth."


@pytest.fixture(scope="module")
def tok(server):
    return AutoTokenizer.from_pretrained(server.model_dir)


def test_tokenize_a_prompt_as_hf_does(http, tok):
    r = http.post("/tokenize", json={"model": "tiny", "prompt": TEXT, "return_token_strs": True})
    assert r.status_code == 200, r.text
    body = r.json()
    ids = tok(TEXT).input_ids
    assert body == {"count": len(ids), "max_model_len": 512, "tokens": ids,
                    "token_strs": tok.convert_ids_to_tokens(ids)}
    bare = http.post("/tokenize", json={"prompt": TEXT, "add_special_tokens": False}).json()
    assert bare["tokens"] == tok(TEXT, add_special_tokens=False).input_ids and bare["token_strs"] is None


def test_tokenize_messages_as_the_chat_endpoint_renders_them(http, tok):
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hello </s> there"}]
    r = http.post("/tokenize", json={"messages": msgs})
    assert r.status_code == 200, r.text
    # The chat endpoint's prompt: its usage counts the same tokens (special-token text kept as text).
    chat = http.post("/v1/chat/completions", json={"model": "tiny", "messages": msgs, "max_tokens": 1})
    assert r.json()["count"] == chat.json()["usage"]["prompt_tokens"]
    text = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    assert tok.decode(r.json()["tokens"]) == text
    partial = [*msgs, {"role": "assistant", "content": "Peace"}]
    open_turn = http.post("/tokenize", json={"messages": partial, "add_generation_prompt": False,
                                             "continue_final_message": True})
    assert tok.decode(open_turn.json()["tokens"]) == tok.apply_chat_template(
        partial, add_generation_prompt=False, continue_final_message=True, tokenize=False)


def test_detokenize_is_hfs_decode(http, tok):
    ids = tok(TEXT).input_ids
    r = http.post("/detokenize", json={"model": "tiny", "tokens": ids})
    assert r.status_code == 200 and r.json() == {"prompt": tok.decode(ids)}, r.text


@pytest.mark.parametrize("path, body, param", [
    ("/tokenize", {"prompt": TEXT, "model": "other"}, "model"),
    ("/tokenize", {"messages": [{"role": "tool", "content": "42"}]}, "messages.0.tool_call_id"),
    ("/tokenize", {"messages": []}, "messages"),
    ("/tokenize", {"model": "tiny"}, "prompt"),
    ("/tokenize", {"prompt": "x", "messages": [{"role": "user", "content": "x"}]}, "messages"),
    ("/tokenize", {"prompt": "x", "tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
    ("/tokenize", {"messages": [{"role": "user", "content": "x"}], "chat_template": "{{ 1 }}"}, "chat_template"),
    ("/tokenize", {"prompt": "x", "mm_processor_kwargs": {"a": 1}}, "mm_processor_kwargs"),
    ("/tokenize", {"messages": [{"role": "user", "content": "x"}], "media_io_kwargs": {"image": {}}},
     "media_io_kwargs"),
    ("/tokenize", {"prompt": "x", "add_generation_prompt": False}, "add_generation_prompt"),
    ("/detokenize", {"tokens": [1, 10**6]}, "tokens"),
    ("/detokenize", {"tokens": [-1]}, "tokens.0"),
])
def test_bad_input_is_a_400_naming_the_field(http, path, body, param):
    r = http.post(path, json=body)
    assert r.status_code in (400, 404), r.text
    assert r.json()["error"]["param"] == param, r.text


def test_tokenize_renders_tools_through_the_chat_template(tools_http, tools_model_dir):
    from test_tool_calls import MSG, TOOLS  # the tools server's own conversation and tools
    ref = AutoTokenizer.from_pretrained(tools_model_dir)
    r = tools_http.post("/tokenize", json={"messages": MSG, "tools": TOOLS})
    assert r.status_code == 200, r.text
    text = ref.apply_chat_template(MSG, tools=TOOLS, tokenize=False, add_generation_prompt=True)
    assert r.json()["tokens"] == ref(text, add_special_tokens=False).input_ids and "get_weather" in text


def test_version(http):
    from pagedserve import __version__
    assert http.get("/version").json() == {"version": __version__}


def test_every_vllm_tokenize_field_is_declared():
    """vLLM 0.26's TokenizeCompletionRequest and TokenizeChatRequest fields (its
    vllm/entrypoints/serve/tokenize/protocol.py): honoured or refused by name, none ignored."""
    from pagedserve.entrypoints.openai.serving_tokenize import TokenizeRequest
    vllm_fields = {"model", "prompt", "add_special_tokens", "return_token_strs", "messages",
                   "add_generation_prompt", "continue_final_message", "chat_template",
                   "chat_template_kwargs", "media_io_kwargs", "mm_processor_kwargs", "tools"}
    assert vllm_fields - set(TokenizeRequest.model_fields) == set()
