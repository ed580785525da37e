"""vLLM 0.26's request extras a vLLM user sends that the audit of test_request_audit.py does not
cover: every one is a field of our models (honoured, or a 400 naming it), and the honoured ones
do what vLLM's do, checked against HF's own tokenizer and chat template on the demo model
(whose tokenizer adds a BOS): add_special_tokens, truncation_side, return_token_ids,
request_id (and the X-Request-Id header), include_reasoning."""
from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from pagedserve.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest

CMPL, CHAT = "/v1/completions", "/v1/chat/completions"
MSG = [{"role": "user", "content": "Tell me about the little fox"}]
TEXT = "Once upon a time there was a little fox who lived in the forest"

# The request fields of vLLM 0.26.0's CompletionRequest and ChatCompletionRequest (its
# vllm/entrypoints/openai/{completion,chat_completion}/protocol.py), OpenAI's among them.
VLLM_COMPLETION_FIELDS = {
    "model", "prompt", "echo", "frequency_penalty", "logit_bias", "logprobs", "max_tokens", "n",
    "presence_penalty", "seed", "stop", "stream", "stream_options", "suffix", "temperature", "top_p",
    "user", "use_beam_search", "top_k", "min_p", "repetition_penalty", "length_penalty",
    "stop_token_ids", "include_stop_str_in_output", "ignore_eos", "min_tokens", "skip_special_tokens",
    "spaces_between_special_tokens", "truncate_prompt_tokens", "truncation_side", "allowed_token_ids",
    "prompt_logprobs", "logprob_token_ids", "bad_words", "prompt_embeds", "add_special_tokens",
    "response_format", "structured_outputs", "priority", "request_id", "return_tokens_as_token_ids",
    "return_token_ids", "return_token_offsets", "cache_salt", "kv_transfer_params",
    "ec_transfer_params", "vllm_xargs", "repetition_detection", "thinking_token_budget"}
VLLM_CHAT_FIELDS = {
    "messages", "model", "frequency_penalty", "logit_bias", "logprobs", "top_logprobs", "max_tokens",
    "max_completion_tokens", "n", "presence_penalty", "response_format", "seed", "stop", "stream",
    "stream_options", "temperature", "top_p", "tools", "tool_choice", "reasoning_effort",
    "thinking_token_budget", "include_reasoning", "parallel_tool_calls", "user", "use_beam_search",
    "top_k", "min_p", "repetition_penalty", "length_penalty", "stop_token_ids",
    "include_stop_str_in_output", "ignore_eos", "min_tokens", "skip_special_tokens",
    "spaces_between_special_tokens", "truncate_prompt_tokens", "truncation_side", "prompt_logprobs",
    "logprob_token_ids", "allowed_token_ids", "bad_words", "echo", "add_generation_prompt",
    "continue_final_message", "add_special_tokens", "documents", "chat_template",
    "chat_template_kwargs", "media_io_kwargs", "mm_processor_kwargs", "structured_outputs",
    "priority", "request_id", "return_tokens_as_token_ids", "return_token_ids",
    "return_token_offsets", "return_prompt_text", "return_assistant_tokens_mask", "cache_salt",
    "kv_transfer_params", "ec_transfer_params", "vllm_xargs", "repetition_detection"}


def test_every_vllm_field_is_declared():
    """None falls through as an unknown key (ignored with a log line): a vLLM user's field is
    honoured or refused by name."""
    assert VLLM_COMPLETION_FIELDS - set(CompletionRequest.model_fields) == set()
    assert VLLM_CHAT_FIELDS - set(ChatCompletionRequest.model_fields) == set()


@pytest.fixture(scope="module")
def ref(tools_model_dir):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(tools_model_dir)


def post(http, path, **body):
    base = {"model": "tiny", "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    r = http.post(path, json={**base, **({"prompt": TEXT} if path == CMPL else {"messages": MSG}), **body})
    assert r.status_code == 200, r.text
    return r.json()


def chunks(http, path, **body):
    base = {"model": "tiny", "max_tokens": 6, "temperature": 0, "ignore_eos": True, "stream": True}
    body = {**base, **({"prompt": TEXT} if path == CMPL else {"messages": MSG}), **body}
    with http.stream("POST", path, json=body) as r:
        assert r.status_code == 200
        return [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]


def test_completion_add_special_tokens(tools_http, ref):
    with_bos = post(tools_http, CMPL, return_token_ids=True)["choices"][0]["prompt_token_ids"]
    bare = post(tools_http, CMPL, return_token_ids=True, add_special_tokens=False)
    assert with_bos == ref(TEXT).input_ids and with_bos[0] == ref.bos_token_id
    assert bare["choices"][0]["prompt_token_ids"] == ref(TEXT, add_special_tokens=False).input_ids
    assert bare["usage"]["prompt_tokens"] == len(with_bos) - 1


@pytest.mark.parametrize("side", ["left", "right"])
def test_truncation_side(tools_http, ref, side):
    """HF's own truncation on that side is the reference for text (the BOS stays); token ids
    keep their first or last ids; a chat's rendered ids likewise."""
    got = post(tools_http, CMPL, return_token_ids=True, truncate_prompt_tokens=5, truncation_side=side)
    ref.truncation_side = side
    assert got["choices"][0]["prompt_token_ids"] == ref(TEXT, truncation=True, max_length=5).input_ids
    ids = list(range(10, 30))
    got = post(tools_http, CMPL, prompt=ids, return_token_ids=True, truncate_prompt_tokens=5, truncation_side=side)
    assert got["choices"][0]["prompt_token_ids"] == (ids[-5:] if side == "left" else ids[:5])
    whole = tools_http.post("/tokenize", json={"messages": MSG}).json()["tokens"]
    got = post(tools_http, CHAT, return_token_ids=True, truncate_prompt_tokens=5, truncation_side=side)
    assert got["prompt_token_ids"] == (whole[-5:] if side == "left" else whole[:5])


def test_chat_add_special_tokens(tools_http, ref):
    """vLLM's chat field: the tokenizer's special tokens on top of the template's (a second BOS
    here), as tokenizing the rendered text with them; /tokenize renders messages the same way."""
    text = ref.apply_chat_template(MSG, add_generation_prompt=True, tokenize=False)
    plain = post(tools_http, CHAT, return_token_ids=True)["prompt_token_ids"]
    added = post(tools_http, CHAT, return_token_ids=True, add_special_tokens=True)["prompt_token_ids"]
    assert plain == ref(text, add_special_tokens=False).input_ids
    assert added == ref(text, add_special_tokens=True).input_ids == [ref.bos_token_id, *plain]
    tokenized = tools_http.post("/tokenize", json={"messages": MSG, "add_special_tokens": True})
    assert tokenized.json()["tokens"] == added


def test_completion_return_token_ids(tools_http, ref):
    """Each choice's token_ids are the tokens its text decodes from; streamed, the chunks' ids add
    up to the same, and the prompt's ids come once, in each choice's first chunk."""
    prompts = [TEXT, "The stars above the forest"]
    whole = post(tools_http, CMPL, prompt=prompts, return_token_ids=True)
    for choice, p in zip(whole["choices"], prompts):
        assert choice["prompt_token_ids"] == ref(p).input_ids
        assert len(choice["token_ids"]) == 6 and ref.decode(choice["token_ids"]) == choice["text"]
    streamed: dict[int, list[int]] = {0: [], 1: []}
    prompt_ids: dict[int, list] = {0: [], 1: []}
    for chunk in chunks(tools_http, CMPL, prompt=prompts, return_token_ids=True):
        for c in chunk["choices"]:
            streamed[c["index"]] += c["token_ids"]
            if "prompt_token_ids" in c:
                prompt_ids[c["index"]].append(c["prompt_token_ids"])
    assert [streamed[i] for i in (0, 1)] == [c["token_ids"] for c in whole["choices"]]
    assert [prompt_ids[i] for i in (0, 1)] == [[c["prompt_token_ids"]] for c in whole["choices"]]
    plain = post(tools_http, CMPL)["choices"][0]
    assert "token_ids" not in plain and "prompt_token_ids" not in plain
    echoed = post(tools_http, CMPL, echo=True, return_token_ids=True)["choices"][0]
    assert echoed["text"] == TEXT + whole["choices"][0]["text"]  # (vLLM 0.26 drops the echo here)
    assert echoed["token_ids"] == whole["choices"][0]["token_ids"]


def test_chat_return_token_ids(tools_http, ref):
    whole = post(tools_http, CHAT, return_token_ids=True)
    choice = whole["choices"][0]
    assert whole["prompt_token_ids"] == tools_http.post("/tokenize", json={"messages": MSG}).json()["tokens"]
    assert len(choice["token_ids"]) == whole["usage"]["completion_tokens"] == 6
    assert ref.decode(choice["token_ids"]) == choice["message"]["content"]
    got = chunks(tools_http, CHAT, return_token_ids=True)
    assert got[0]["prompt_token_ids"] == whole["prompt_token_ids"]
    assert all("prompt_token_ids" not in c for c in got[1:])
    assert sum((c["choices"][0]["token_ids"] for c in got[1:]), []) == choice["token_ids"]


def test_request_id(tools_http):
    """vLLM's: the field names the response (cmpl-<id>, chatcmpl-<id>), an X-Request-Id header
    before it; equal ids from two clients at once both run."""
    assert post(tools_http, CMPL, request_id="job-7")["id"] == "cmpl-job-7"
    assert post(tools_http, CHAT, request_id="job-7")["id"] == "chatcmpl-job-7"
    r = tools_http.post(CMPL, json={"prompt": TEXT, "max_tokens": 2, "request_id": "field"},
                        headers={"X-Request-Id": "header"})
    assert r.json()["id"] == "cmpl-header"
    assert {c["id"] for c in chunks(tools_http, CHAT, request_id="s-1")} == {"chatcmpl-s-1"}
    with ThreadPoolExecutor(4) as pool:
        outs = list(pool.map(lambda _: post(tools_http, CMPL, request_id="same", max_tokens=32), range(4)))
    assert {o["id"] for o in outs} == {"cmpl-same"}
    assert len({o["choices"][0]["text"] for o in outs}) == 1  # the same greedy answer, none cut
    bad = tools_http.post(CMPL, json={"prompt": TEXT, "request_id": ""})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "request_id"


def test_token_ids_in_a_reasoning_stream_are_all_there(tools_http):
    """With the reasoning parser on, a chunk held back by the parser still carries its ids."""
    whole = post(tools_http, CHAT, return_token_ids=True, max_tokens=16)
    got = chunks(tools_http, CHAT, return_token_ids=True, max_tokens=16)
    assert sum((c["choices"][0]["token_ids"] for c in got[1:]), []) == whole["choices"][0]["token_ids"]


# The refused ones (prompt_embeds, logprob_token_ids, ...) are in test_request_audit.py's UNHONOURED.


def test_no_op_extras_are_accepted(tools_http):
    post(tools_http, CHAT, thinking_token_budget=-1, mm_processor_kwargs={}, media_io_kwargs={},
         return_prompt_text=False, return_token_offsets=False, logprob_token_ids=[], include_reasoning=True)
    post(tools_http, CMPL, ec_transfer_params={}, return_token_offsets=False, add_special_tokens=True)


@pytest.fixture(scope="module")
def r1_http(tmp_path_factory):
    """The demo model under deepseek_r1's parser: its template opened <think>, so text without
    </think> (all the demo model writes) is reasoning."""
    from server_process import start_server, stop_server

    from pagedserve.demo_model import DEMO_MODEL_DIR
    log = tmp_path_factory.mktemp("r1-server") / "server.log"
    s = start_server(DEMO_MODEL_DIR, log, "--max-model-len", "256", "--num-gpu-blocks-override", "64",
                     "--swap-space", "0.05", "--reasoning-parser", "deepseek_r1")
    with httpx.Client(base_url=s.base_url, timeout=120) as c:
        yield c
    stop_server(s)


def test_include_reasoning_false_withholds_the_reasoning(r1_http):
    """vLLM's include_reasoning=false: no reasoning_content, and no logprobs or token ids that
    would spell it out; streamed, no chunk shows it."""
    shown = post(r1_http, CHAT, logprobs=True, return_token_ids=True)["choices"][0]
    assert shown["message"]["reasoning_content"] and shown["logprobs"] and shown["token_ids"]
    hidden = post(r1_http, CHAT, logprobs=True, return_token_ids=True, include_reasoning=False)["choices"][0]
    assert hidden["message"]["reasoning_content"] is None and hidden["message"]["content"] in (None, "")
    assert hidden["logprobs"] is None and "token_ids" not in hidden
    assert hidden["finish_reason"] == shown["finish_reason"] == "length"
    got = chunks(r1_http, CHAT, logprobs=True, return_token_ids=True, include_reasoning=False)
    for chunk in got:
        for c in chunk["choices"]:
            assert "reasoning_content" not in c["delta"] and c["logprobs"] is None and "token_ids" not in c
    assert got[-1]["choices"][0]["finish_reason"] == "length"
    streamed = chunks(r1_http, CHAT, include_reasoning=True)
    text = "".join(c["choices"][0]["delta"].get("reasoning_content") or "" for c in streamed)
    assert text == shown["message"]["reasoning_content"]


def test_ping_is_health(tools_http):
    """vLLM's /ping (GET or POST, SageMaker's check) answers as /health does."""
    assert tools_http.get("/ping").status_code == tools_http.post("/ping").status_code == 200


def test_continuous_usage_stats(tools_http):
    """vLLM's stream_options.continuous_usage_stats: with include_usage, each chunk carries its
    choice's usage so far (its prompt's tokens, the tokens it streamed: counted here from the
    chunks' own token ids); the last chunk the totals. Without include_usage it adds nothing."""
    prompts = [TEXT, "The stars above the forest"]
    opts = {"include_usage": True, "continuous_usage_stats": True}
    got = chunks(tools_http, CMPL, prompt=prompts, return_token_ids=True, stream_options=opts)
    lens = {i: len(post(tools_http, CMPL, prompt=p, return_token_ids=True)["choices"][0]["prompt_token_ids"])
            for i, p in enumerate(prompts)}
    seen = {0: 0, 1: 0}
    for chunk in got[:-1]:
        (c,) = chunk["choices"]
        seen[c["index"]] += len(c["token_ids"])
        assert chunk["usage"] == {"prompt_tokens": lens[c["index"]], "completion_tokens": seen[c["index"]],
                                  "total_tokens": lens[c["index"]] + seen[c["index"]]}
    assert got[-1]["choices"] == [] and got[-1]["usage"]["completion_tokens"] == 12 == sum(seen.values())
    chat = chunks(tools_http, CHAT, return_token_ids=True, stream_options=opts)
    prompt_len = len(chat[0]["prompt_token_ids"])
    assert chat[0]["usage"]["completion_tokens"] == 0 and chat[0]["usage"]["prompt_tokens"] == prompt_len
    n = 0
    for chunk in chat[1:-1]:
        n += len(chunk["choices"][0]["token_ids"])
        assert chunk["usage"] == {"prompt_tokens": prompt_len, "completion_tokens": n, "total_tokens": prompt_len + n}
    assert chat[-1]["usage"]["completion_tokens"] == n == 6
    alone = chunks(tools_http, CHAT, stream_options={"continuous_usage_stats": True})
    assert all(c["usage"] is None for c in alone)


def test_chat_echo(tools_http):
    """vLLM's chat echo: the last message's text before the answer's where its role is the
    answer's (assistant, or without a generation prompt the last message's own), streamed as
    its own chunk after the role; otherwise nothing changes."""
    partial = [*MSG, {"role": "assistant", "content": "Once upon a time"}]
    body = dict(messages=partial, add_generation_prompt=False, continue_final_message=True)
    plain = post(tools_http, CHAT, **body)["choices"][0]["message"]
    echoed = post(tools_http, CHAT, echo=True, **body)["choices"][0]["message"]
    assert echoed == {**plain, "content": "Once upon a time" + plain["content"]}
    got = chunks(tools_http, CHAT, echo=True, **body)
    assert got[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert got[1]["choices"][0]["delta"] == {"content": "Once upon a time"}
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in got) == echoed["content"]
    # a user message last, no generation prompt: the answer's role is the user's, echoed too
    user = post(tools_http, CHAT, echo=True, add_generation_prompt=False)["choices"][0]["message"]
    alone = post(tools_http, CHAT, add_generation_prompt=False)["choices"][0]["message"]
    assert user["role"] == alone["role"] == "user" and user["content"] == MSG[0]["content"] + alone["content"]
    # with the generation prompt the answer is the assistant's: a user message is not echoed
    assert post(tools_http, CHAT, echo=True)["choices"][0]["message"] == post(tools_http, CHAT)["choices"][0]["message"]


@pytest.mark.parametrize("logprobs", [None, 1])
def test_repetition_detection(tools_http, logprobs):
    """vLLM's repetition_detection through the server: a bias that makes one token win every step
    repeats it, so the output ends after min_count of it, finish_reason "repetition" (streamed
    too); the core's token-only rows and its rows with logprobs alike."""
    rd = {"max_pattern_size": 2, "min_count": 3}
    body = dict(logit_bias={"100": 100}, repetition_detection=rd, max_tokens=16, logprobs=logprobs)
    c = post(tools_http, CMPL, return_token_ids=True, **body)["choices"][0]
    assert (c["token_ids"], c["finish_reason"], c["stop_reason"]) == ([100] * 3, "repetition", "repetition_detected")
    last = chunks(tools_http, CMPL, **body)[-1]["choices"][0]
    assert (last["finish_reason"], last["stop_reason"]) == ("repetition", "repetition_detected")
    assert post(tools_http, CMPL, **{**body, "min_tokens": 5})["usage"]["completion_tokens"] == 5
    free = post(tools_http, CMPL, logit_bias={"100": 100}, max_tokens=16)["choices"][0]
    assert free["finish_reason"] == "length"


@pytest.mark.parametrize("body", [
    {"repetition_detection": {"max_pattern_size": 2, "min_count": 1}},
    {"repetition_detection": {"max_pattern_size": 1, "min_pattern_size": 2, "min_count": 2}},
    {"repetition_detection": {"max_pattern_size": -1}},
    {"repetition_detection": {"max_pattern_size": 2, "min_count": 2}, "use_beam_search": True, "n": 2},
])
def test_bad_repetition_detection_is_a_400(tools_http, body):
    r = tools_http.post(CMPL, json={"prompt": TEXT, "max_tokens": 4, **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"].startswith("repetition_detection")


def test_return_prompt_text(tools_http, ref):
    """vLLM's return_prompt_text: the chat template's text (HF's rendering is the reference),
    at the top of the answer, and streamed in the role chunk; its tokens are the prompt's."""
    text = ref.apply_chat_template(MSG, add_generation_prompt=True, tokenize=False)
    whole = post(tools_http, CHAT, return_prompt_text=True, return_token_ids=True)
    assert whole["prompt_text"] == text
    assert ref(text, add_special_tokens=False).input_ids == whole["prompt_token_ids"]
    got = chunks(tools_http, CHAT, return_prompt_text=True)
    assert got[0]["prompt_text"] == text and all("prompt_text" not in c for c in got[1:])
    assert "prompt_text" not in post(tools_http, CHAT)
    partial = [*MSG, {"role": "assistant", "content": "Once upon"}]
    open_turn = post(tools_http, CHAT, messages=partial, add_generation_prompt=False,
                     continue_final_message=True, return_prompt_text=True)["prompt_text"]
    assert open_turn == ref.apply_chat_template(partial, continue_final_message=True, tokenize=False)
