"""The DP router's chat routing keys are the ids the replicas render (no servers).

The replica's side is the real thing: OpenAIServingChat._render on the tools plan_tools gives it,
as create() calls them. A router key that differs from those ids never finds the replica that
cached the prompt, silently (answers stay right, placement does not).
"""
from __future__ import annotations

import asyncio
import json
import sys
from types import SimpleNamespace

import pytest

from pagedserve.entrypoints.openai.protocol import ChatCompletionRequest
from pagedserve.serving.prefix_key import chat_token_ids, prefix_block_hashes, request_token_ids

# Shows a message's parts one by one when its content is a list of them (so "auto" means "openai").
PARTS = ("{% for m in messages %}[{{ m['role'] }}]"
         "{% if m['content'] is string %}{{ m['content'] }}"
         "{% else %}{% for p in m['content'] %}<{{ p['text'] }}>{% endfor %}{% endif %}\n{% endfor %}"
         "{% if add_generation_prompt %}[assistant]{% endif %}")
# Everything a chat request may carry besides its messages' text.
FULL = ("{% if greeting %}{{ greeting }}\n{% endif %}"
        "{% if tools %}TOOLS {{ tools | tojson }}\n{% endif %}"
        "{% for m in messages %}[{{ m['role'] }}]"
        "{% if m.tool_calls %}{% for c in m.tool_calls %}CALL {{ c.id }} {{ c.function.name }}"
        "{{ c.function.arguments | tojson }}{% endfor %}{% endif %}"
        "{% if m.tool_call_id %}(answers {{ m.tool_call_id }}){% endif %}"
        "{{ m['content'] }}<end>\n{% endfor %}"
        "{% if add_generation_prompt %}[assistant]{% endif %}")

TOOL = {"type": "function", "function": {"name": "get_weather", "description": "today's weather",
                                         "parameters": {"type": "object",
                                                        "properties": {"city": {"type": "string"}}}}}
HISTORY = [{"role": "user", "content": "What is the weather in Paris?"},
           {"role": "assistant", "content": None,
            "tool_calls": [{"id": "call_1", "type": "function",
                            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
           {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"}]


class RecordingPool:
    """A replica pool that answers {} and records each request's routing key."""
    backend = "test"

    def __init__(self):
        self.seen = []

    async def forward(self, method, path, raw, hashes):
        from pagedserve.serving.pool import ReplicaResponse, one_chunk
        self.seen.append(list(hashes))
        return ReplicaResponse(200, "application/json", one_chunk(b"{}"))


def front_end_keys(tok, requests: list[tuple[str, dict]], **app_kwargs) -> list[list[bytes]]:
    """The routing keys build_dp_app's front end (what launch.py, ray_app.py and the relay workers
    build) computes for each (path, body), in order."""
    import httpx

    from pagedserve.serving.frontend import build_dp_app

    async def run():
        pool = RecordingPool()
        app = build_dp_app(pool, tok, 4, manage_pool=False, **app_kwargs)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://dp") as c:
            for path, body in requests:
                assert (await c.post(path, json=body)).status_code == 200
        return pool.seen
    return asyncio.run(run())


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    """The router's tokenizer of the demo model under a --chat-template (the replicas load the
    same one: both go through engine.input_processor.load_tokenizer)."""
    from pagedserve.demo_model import DEMO_MODEL_DIR
    from pagedserve.serving.prefix_key import load_tokenizer_path
    folder = tmp_path_factory.mktemp("templates")
    cache = {}

    def get(template: str):
        if template not in cache:
            path = folder / f"t{len(cache)}.jinja"
            path.write_text(template)
            cache[template] = load_tokenizer_path(str(DEMO_MODEL_DIR), str(path))
        return cache[template]
    return get


def replica_ids(tok, body: dict, fmt: str) -> list[int]:
    """What a replica started with --chat-template-content-format fmt (and
    --enable-auto-tool-choice --tool-call-parser hermes) renders for body, as create() does."""
    from pagedserve.entrypoints.openai.serving_chat import OpenAIServingChat
    from pagedserve.entrypoints.openai.tool_parsers import HermesToolParser
    from pagedserve.entrypoints.openai.tools import plan_tools
    chat = OpenAIServingChat(SimpleNamespace(tokenizer=tok), "m", tool_parser=HermesToolParser,
                             content_format=fmt)
    req = ChatCompletionRequest.model_validate(body)
    return chat._render(req, plan_tools(req, chat.auto_tool_parser).tools)


def router_ids(tok, body: dict, fmt: str) -> list[int]:
    ids = chat_token_ids(tok, ChatCompletionRequest.model_validate(body), fmt)
    # The body-level entry agrees (its tests: test_routing.py).
    assert request_token_ids(tok, "/v1/chat/completions", json.dumps(body).encode(), fmt) == ids
    return ids


@pytest.mark.parametrize("fmt", ["openai", "auto", "string"])
def test_list_content_is_keyed_in_the_replicas_content_format(tokenizer, fmt):
    """(Under "openai"/"auto" the old router joined the parts by newlines all the same.)"""
    tok = tokenizer(PARTS)
    body = {"messages": [{"role": "system", "content": "Be brief."},
                         {"role": "user", "content": [{"type": "text", "text": "first part"},
                                                      {"type": "text", "text": "second part"}]}]}
    ids = replica_ids(tok, body, fmt)
    assert router_ids(tok, body, fmt) == ids
    # The formats do render differently here: a router using the wrong one would miss.
    other = "string" if fmt != "string" else "openai"
    assert replica_ids(tok, body, other) != ids


@pytest.mark.parametrize("fmt", ["string", "openai"])
def test_history_tool_calls_and_tool_messages_are_keyed(tokenizer, fmt):
    tok = tokenizer(FULL)
    body = {"messages": HISTORY}
    ids = replica_ids(tok, body, fmt)
    assert "CALL call_1 get_weather" in tok.decode(ids) and "(answers call_1)" in tok.decode(ids)
    assert router_ids(tok, body, fmt) == ids


@pytest.mark.parametrize("choice", [None, "auto", "none", "required",
                                    {"type": "function", "function": {"name": "get_weather"}}])
def test_tools_are_keyed_as_the_replica_renders_them(tokenizer, choice):
    """The tools are part of the prompt whatever tool_choice says; with auto (the default) the
    router lacks the replicas' --tool-call-parser and still keys what they render."""
    tok = tokenizer(FULL)
    body = {"messages": HISTORY[:1], "tools": [TOOL], **({} if choice is None else {"tool_choice": choice})}
    ids = replica_ids(tok, body, "auto")
    assert "TOOLS" in tok.decode(ids) and "get_weather" in tok.decode(ids)
    assert router_ids(tok, body, "auto") == ids


@pytest.mark.parametrize("extra", [{"chat_template_kwargs": {"greeting": "Hello there"}},
                                   {"continue_final_message": True, "add_generation_prompt": False}])
def test_template_kwargs_and_continue_final_message_are_keyed(tokenizer, extra):
    tok = tokenizer(FULL)
    body = {"messages": [{"role": "user", "content": "Write a poem"},
                         {"role": "assistant", "content": "Roses are"}], **extra}
    ids = replica_ids(tok, body, "auto")
    assert router_ids(tok, body, "auto") == ids
    assert ids != replica_ids(tok, {k: v for k, v in body.items() if k == "messages" or k == "add_generation_prompt"},
                              "auto")


def test_a_body_the_replica_cannot_render_has_no_key(tokenizer):
    """The replica answers these with its own 400; the router keys them [] (routed by load)
    and never raises. (The old router keyed the kwargs clash as if the kwargs were absent.)"""
    from pagedserve.entrypoints.openai.serving_common import APIError
    from pagedserve.demo_model import DEMO_MODEL_DIR
    from pagedserve.serving.prefix_key import load_tokenizer_path
    demo = load_tokenizer_path(str(DEMO_MODEL_DIR))  # its template refuses the role "tool"
    user = [{"role": "user", "content": "hi"}]
    cases = [(tokenizer(FULL), {"messages": user, "chat_template_kwargs": {"tools": [TOOL]}}),
             (demo, {"messages": HISTORY}),
             (tokenizer(FULL), {"messages": user, "tools": [TOOL, TOOL]}),  # plan_tools: two functions named alike
             (tokenizer(FULL), {"messages": user, "tool_choice": "required"})]  # tool_choice needs tools
    for tok, body in cases:
        with pytest.raises(APIError):
            replica_ids(tok, body, "auto")
        assert router_ids(tok, body, "auto") == []
    plain = SimpleNamespace(chat_template=None)  # a tokenizer without a chat template
    assert chat_token_ids(plain, ChatCompletionRequest.model_validate({"messages": user})) == []


def test_the_front_end_keys_chat_in_the_content_format_it_is_given(tokenizer):
    """build_dp_app's routing key hashes the ids the replicas render under their
    --chat-template-content-format."""
    tok = tokenizer(PARTS)
    body = {"messages": [{"role": "user", "content": [{"type": "text", "text": "first part"},
                                                      {"type": "text", "text": "second part"}]}]}

    def key(fmt: str) -> list[bytes]:
        return front_end_keys(tok, [("/v1/chat/completions", body)], chat_template_content_format=fmt)[0]

    for fmt in ("openai", "string"):
        got = key(fmt)
        assert got and got == prefix_block_hashes(replica_ids(tok, body, fmt), 4)
    assert key("openai") != key("string")


def test_relay_workers_carry_the_content_format():
    """Each relay worker is a router too: the front end passes the replicas' content format
    on its command line, as it passes --chat-template."""
    from pagedserve.serving.relay_worker import RelayWorkers, parse_worker_args
    for fmt in ("openai", "string", "auto"):
        cmd = RelayWorkers(1, "127.0.0.1", 1, "ipc://x", "/tok", 16, 1024, chat_template="t.jinja",
                           chat_template_content_format=fmt).cmds[0]
        assert cmd[:3] == [sys.executable, "-m", "pagedserve.serving.relay_worker"]
        args = parse_worker_args(cmd[3:])
        assert (args.tokenizer, args.chat_template, args.chat_template_content_format) == ("/tok", "t.jinja", fmt)
    bare = parse_worker_args(RelayWorkers(1, "127.0.0.1", 1, "ipc://x", None, 16, 1024).cmds[0][3:])
    assert bare.chat_template_content_format == "auto"  # no tokenizer: no chat keys at all


def test_the_front_end_keys_only_what_truncate_prompt_tokens_keeps(tokenizer):
    """A replica keeps (and caches) a prompt's last truncate_prompt_tokens ids: the key hashes
    those, for chat and completions, so two prompts that differ only before the kept tail share a
    key and a replica; -1 (max_model_len - max_tokens, which the router does not know) keys the
    whole prompt."""
    tok = tokenizer(PARTS)
    tail = "and the earth was without form, and void; and darkness was upon the face of the deep"
    chat = [{"messages": [{"role": "user", "content": head + tail}]} for head in ("In the beginning ", "Lo, ")]
    ids = [replica_ids(tok, b, "auto") for b in chat]
    keep = len(ids[0]) - 6  # cuts inside the differing head of the first, at most the second's whole
    got = front_end_keys(tok, [("/v1/chat/completions", {**b, "truncate_prompt_tokens": keep}) for b in chat])
    assert got[0] == prefix_block_hashes(ids[0][-keep:], 4) and got[0]
    assert got[1] == prefix_block_hashes(ids[1][-keep:], 4)
    whole = front_end_keys(tok, [("/v1/chat/completions", {**chat[0], "truncate_prompt_tokens": -1})])
    assert whole[0] == prefix_block_hashes(ids[0], 4) != got[0]
    prompt = list(range(5, 45))
    got = front_end_keys(tok, [("/v1/completions", {"prompt": prompt, "truncate_prompt_tokens": 17}),
                               ("/v1/completions", {"prompt": [9, 9, 9] + prompt[-17:], "truncate_prompt_tokens": 17})])
    assert got[0] == got[1] == prefix_block_hashes(prompt[-17:], 4)


def test_a_text_prompts_key_keeps_the_bos_as_the_replica_does(tokenizer):
    """The demo tokenizer adds a BOS: a replica cuts a text prompt with the tokenizer's own left
    truncation (vLLM's), keeping the BOS and the text's last tokens, not the last ids of the
    whole tokenization; the router's key hashes those same ids. HF's tokenizer is the reference,
    the replica's side its completions front end (OpenAIServingCompletion._prompts)."""
    from transformers import AutoTokenizer

    from pagedserve.demo_model import DEMO_MODEL_DIR
    from pagedserve.entrypoints.openai.protocol import CompletionRequest
    from pagedserve.entrypoints.openai.serving_completion import OpenAIServingCompletion
    tok = tokenizer(PARTS)
    text = "and the earth was without form, and void; and darkness was upon the face of the deep " * 2
    keep = 13
    ref = AutoTokenizer.from_pretrained(DEMO_MODEL_DIR, truncation_side="left")
    want = ref(text, truncation=True, max_length=keep).input_ids
    assert want[0] == ref.bos_token_id and want != ref(text).input_ids[-keep:]

    async def run(fn, *args, **kw):
        return fn(*args, **kw)
    replica = OpenAIServingCompletion(SimpleNamespace(tokenizer=tok, run=run, max_model_len=1024, vocab_size=10**6), "m")
    req = CompletionRequest.model_validate({"prompt": text, "truncate_prompt_tokens": keep})
    kept = asyncio.run(replica._prompts(req, replica.truncation_size(keep, req.max_tokens, "max_tokens")))[0].token_ids
    assert kept == want
    got = front_end_keys(tok, [("/v1/completions", {"prompt": text, "truncate_prompt_tokens": keep})])[0]
    assert got == prefix_block_hashes(want, 4) and got
    assert request_token_ids(tok, "/v1/completions",
                             json.dumps({"prompt": text, "truncate_prompt_tokens": keep}).encode()) == want


@pytest.mark.parametrize("special", [True, False])
@pytest.mark.parametrize("side", [None, "left", "right"])
def test_keys_follow_add_special_tokens_and_truncation_side(tokenizer, special, side):
    """vLLM's add_special_tokens and truncation_side change the ids a replica runs: the router's
    key follows them, for a text prompt, token ids and a chat's rendered prompt (with the chat's
    add_special_tokens, its BOS on top of the template's)."""
    from pagedserve.entrypoints.openai.protocol import CompletionRequest
    from pagedserve.entrypoints.openai.serving_completion import OpenAIServingCompletion
    tok = tokenizer(PARTS)
    text = "and the earth was without form, and void; and darkness was upon the face of the deep " * 2

    async def run(fn, *args, **kw):
        return fn(*args, **kw)
    replica = OpenAIServingCompletion(SimpleNamespace(tokenizer=tok, run=run, max_model_len=1024, vocab_size=10**6), "m")
    for prompt in (text, list(range(40, 80))):
        body = {"prompt": prompt, "truncate_prompt_tokens": 13, "add_special_tokens": special,
                **({"truncation_side": side} if side else {})}
        req = CompletionRequest.model_validate(body)
        kept = asyncio.run(replica._prompts(req, replica.truncation_size(13, req.max_tokens, "max_tokens")))[0].token_ids
        assert len(kept) == 13
        assert request_token_ids(tok, "/v1/completions", json.dumps(body).encode()) == kept
        assert front_end_keys(tok, [("/v1/completions", body)])[0] == prefix_block_hashes(kept, 4)
    msgs = [{"role": "user", "content": text}]
    body = {"messages": msgs, "add_special_tokens": special, "truncate_prompt_tokens": 9,
            **({"truncation_side": side} if side else {})}
    whole = replica_ids(tok, {"messages": msgs, "add_special_tokens": special}, "string")
    want = whole[:9] if side == "right" else whole[-9:]
    assert request_token_ids(tok, "/v1/chat/completions", json.dumps(body).encode(), "string") == want
    keys = front_end_keys(tok, [("/v1/chat/completions", body)], chat_template_content_format="string")
    assert keys[0] == prefix_block_hashes(want, 4)
    assert (whole[0] == tok.bos_token_id) == special  # (PARTS writes no BOS of its own)
