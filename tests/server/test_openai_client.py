"""The official openai client against a real server; outputs checked against HF transformers."""
from __future__ import annotations

import json

import pytest
import torch

from logprob_reference import vllm_name

PROMPT = "The quick brown fox jumps over"


def hf_greedy(hf_model, ids: list[int], n: int) -> tuple[list[int], list[torch.Tensor]]:
    """n greedy tokens from HF (no EOS stop, as ignore_eos) and the log-softmax at each step."""
    model, _ = hf_model
    ids = list(ids)
    out, logps = [], []
    with torch.no_grad():
        for _ in range(n):
            logits = model(torch.tensor([ids])).logits[0, -1].float()
            lp = torch.log_softmax(logits, -1)
            t = int(lp.argmax())
            out.append(t)
            logps.append(lp)
            ids.append(t)
    return out, logps


def test_models_lists_the_served_model(client, server):
    models = client.models.list()
    assert [m.id for m in models.data] == [server.model]


def test_completion_greedy_matches_hf(client, server, hf_model):
    _, tok = hf_model
    r = client.completions.create(model=server.model, prompt=PROMPT, max_tokens=10, temperature=0,
                                  extra_body={"ignore_eos": True})
    ids = tok(PROMPT).input_ids
    ref, _ = hf_greedy(hf_model, ids, 10)
    assert r.choices[0].text == tok.decode(ref, skip_special_tokens=True)
    assert r.choices[0].finish_reason == "length"
    assert r.id.startswith("cmpl-") and r.object == "text_completion" and r.model == server.model
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(ids), 10)
    assert r.usage.total_tokens == len(ids) + 10


def test_completion_token_id_prompts_batch(client, server, hf_model):
    _, tok = hf_model
    prompts = [tok("Paged attention").input_ids, tok("Numbers: 1 2").input_ids]
    r = client.completions.create(model=server.model, prompt=prompts, max_tokens=6, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert [c.index for c in r.choices] == [0, 1]
    for c, ids in zip(r.choices, prompts):
        ref, _ = hf_greedy(hf_model, ids, 6)
        assert c.text == tok.decode(ref, skip_special_tokens=True)
    assert r.usage.prompt_tokens == sum(map(len, prompts))
    assert r.usage.completion_tokens == 12


def test_completion_logprobs_match_hf(client, server, hf_model):
    _, tok = hf_model
    r = client.completions.create(model=server.model, prompt=PROMPT, max_tokens=5, temperature=0,
                                  logprobs=3, extra_body={"ignore_eos": True})
    ref, logps = hf_greedy(hf_model, tok(PROMPT).input_ids, 5)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
    for i, (t, ref_lp) in enumerate(zip(ref, logps)):
        ctx = ref[max(0, i - 4):i]
        assert lp.tokens[i] == vllm_name(tok, t, ctx)  # vLLM's decoded_token
        assert lp.token_logprobs[i] == pytest.approx(float(ref_lp[t]), abs=1e-3)
        top = dict(lp.top_logprobs[i])
        want = torch.topk(ref_lp, 3)
        # keyed by name, most likely first: tokens named alike share a key, the last one's value
        want = {vllm_name(tok, int(j), ctx): v for j, v in zip(want.indices.tolist(), want.values.tolist())}
        assert list(top) == list(want) and list(top.values()) == pytest.approx(list(want.values()), abs=1e-3)
    # text_offset: where each token starts in the returned text
    offsets = [0]
    for s in lp.tokens[:-1]:
        offsets.append(offsets[-1] + len(s))
    assert lp.text_offset == offsets


@pytest.mark.parametrize("k", [0, 2])
def test_completion_top_logprobs_hold_the_chosen_token_beside_the_top_k(http, server, hf_model, k):
    """OpenAI's completions and vLLM's give up to logprobs + 1 entries: the chosen token first,
    then the top k. allowed_token_ids forces the least likely token (logprobs stay the raw
    model's, as vLLM's), so it is outside the top k and must still be there."""
    _, tok = hf_model
    ids = tok(PROMPT).input_ids
    _, (lp0,) = hf_greedy(hf_model, ids, 1)
    least = int(lp0.argmin())
    r = http.post("/v1/completions", json={"model": server.model, "prompt": ids, "max_tokens": 1, "logprobs": k,
                                           "allowed_token_ids": [least], "temperature": 1.0, "seed": 0})
    assert r.status_code == 200, r.text
    lp = r.json()["choices"][0]["logprobs"]
    assert lp["tokens"] == [vllm_name(tok, least, [])]
    assert lp["token_logprobs"][0] == pytest.approx(float(lp0[least]), abs=1e-3)
    top = torch.topk(lp0, k)
    want = {vllm_name(tok, least, []): float(lp0[least]),
            **{vllm_name(tok, int(j), []): v for j, v in zip(top.indices.tolist(), top.values.tolist())}}
    got = lp["top_logprobs"][0]
    assert list(got) == list(want) and list(got.values()) == pytest.approx(list(want.values()), abs=1e-3)
    assert len(got) == k + 1


@pytest.mark.parametrize("stream", [False, True])
def test_return_tokens_as_token_ids_names_logprob_tokens_by_id(http, server, hf_model, stream):
    """vLLM's extra: logprobs name each token "token_id:N" (HF's greedy ids), chat and completions,
    whole and streamed; the text and text_offset stay the tokens' text."""
    _, tok = hf_model
    ref, logps = hf_greedy(hf_model, tok(PROMPT).input_ids, 4)
    body = {"model": server.model, "prompt": PROMPT, "max_tokens": 4, "temperature": 0, "logprobs": 2,
            "ignore_eos": True, "return_tokens_as_token_ids": True, "stream": stream}
    r = http.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    if stream:
        chunks = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
        lps = [c["choices"][0]["logprobs"] for c in chunks if c["choices"] and c["choices"][0]["logprobs"]]
        lp = {k: [x for one in lps for x in one[k]] for k in ("tokens", "top_logprobs", "text_offset")}
    else:
        lp = r.json()["choices"][0]["logprobs"]
    assert lp["tokens"] == [f"token_id:{t}" for t in ref]
    for top, ref_lp in zip(lp["top_logprobs"], logps):
        assert set(top) == {f"token_id:{int(t)}" for t in torch.topk(ref_lp, 2).indices}
    assert lp["text_offset"] == [sum(len(tok.decode([t])) for t in ref[:i]) for i in range(4)]
    chat = http.post("/v1/chat/completions", json={
        "model": server.model, "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 3,
        "temperature": 0, "logprobs": True, "top_logprobs": 1, "ignore_eos": True,
        "return_tokens_as_token_ids": True}).json()
    content = chat["choices"][0]["logprobs"]["content"]
    assert all(c["token"].startswith("token_id:") and c["bytes"] == list(c["token"].encode()) and
               c["top_logprobs"][0]["token"] == c["token"] for c in content), content


def test_truncate_prompt_tokens_keeps_the_prompts_last_tokens(http, server, hf_model):
    """vLLM's extra: the prompt's last k tokens are the prompt (HF's greedy on them), echoed as
    their text; k -1 is max_model_len; 0 a 400 naming the field."""
    _, tok = hf_model
    ids = tok(PROMPT).input_ids
    body = {"model": server.model, "prompt": PROMPT, "max_tokens": 4, "temperature": 0, "ignore_eos": True,
            "truncate_prompt_tokens": 3, "echo": True}
    r = http.post("/v1/completions", json=body).json()
    ref, _ = hf_greedy(hf_model, ids[-3:], 4)
    assert r["usage"]["prompt_tokens"] == 3
    assert r["choices"][0]["text"] == tok.decode(ids[-3:]) + tok.decode(ref, skip_special_tokens=True)
    assert http.post("/v1/completions", json={**body, "truncate_prompt_tokens": -1}).json()["usage"][
        "prompt_tokens"] == len(ids)
    msgs = [{"role": "user", "content": PROMPT}]
    chat = http.post("/v1/chat/completions", json={"model": server.model, "messages": msgs, "max_tokens": 1,
                                                   "truncate_prompt_tokens": 5}).json()
    assert chat["usage"]["prompt_tokens"] == 5
    bad = http.post("/v1/completions", json={**body, "truncate_prompt_tokens": 0})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "truncate_prompt_tokens", bad.text


def test_chat_greedy_matches_hf_with_template(client, server, hf_model):
    _, tok = hf_model
    messages = [{"role": "system", "content": "You are terse."},
                {"role": "user", "content": "Say hello to the fox."}]
    r = client.chat.completions.create(model=server.model, messages=messages, max_tokens=8,
                                       temperature=0, logprobs=True, top_logprobs=2,
                                       extra_body={"ignore_eos": True})
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    ids = tok(text, add_special_tokens=False).input_ids
    ref, logps = hf_greedy(hf_model, ids, 8)
    ch = r.choices[0]
    assert r.id.startswith("chatcmpl-") and r.object == "chat.completion"
    assert ch.message.role == "assistant"
    assert ch.message.content == tok.decode(ref, skip_special_tokens=True)
    assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == 8
    content = ch.logprobs.content
    assert len(content) == 8
    for item, t, ref_lp in zip(content, ref, logps):
        assert item.logprob == pytest.approx(float(ref_lp[t]), abs=1e-3)
        assert item.bytes == list(item.token.encode())
        assert len(item.top_logprobs) == 2
        assert item.top_logprobs[0].logprob == pytest.approx(float(ref_lp.max()), abs=1e-3)


def test_chat_max_completion_tokens(client, server):
    r = client.chat.completions.create(model=server.model, messages=[{"role": "user", "content": "hi"}],
                                       max_completion_tokens=3, temperature=0,
                                       extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 3 and r.choices[0].finish_reason == "length"


def test_streaming_completion_equals_non_streaming(client, server):
    kw = dict(model=server.model, prompt=PROMPT, max_tokens=12, temperature=0,
              extra_body={"ignore_eos": True})
    full = client.completions.create(**kw).choices[0].text
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    text_chunks = [c for c in chunks if c.choices]
    assert "".join(c.choices[0].text for c in text_chunks) == full
    assert text_chunks[-1].choices[0].finish_reason == "length"
    assert all(c.choices[0].finish_reason is None for c in text_chunks[:-1])
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 12
    assert len({c.id for c in chunks}) == 1


def test_streaming_chat_equals_non_streaming(client, server):
    kw = dict(model=server.model, messages=[{"role": "user", "content": "Tell me about blocks."}],
              max_tokens=10, temperature=0, extra_body={"ignore_eos": True})
    full = client.chat.completions.create(**kw).choices[0].message.content
    chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True},
                                                 **kw))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == full
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 10
    assert all(c.object == "chat.completion.chunk" for c in chunks)


def test_n2_gives_two_choices(client, server):
    r = client.completions.create(model=server.model, prompt=PROMPT, max_tokens=6, n=2,
                                  temperature=1.0, seed=7, extra_body={"ignore_eos": True})
    assert sorted(c.index for c in r.choices) == [0, 1]
    assert r.usage.completion_tokens == 12
    chat = client.chat.completions.create(model=server.model, messages=[{"role": "user", "content": "hi"}],
                                          max_tokens=4, n=2, temperature=1.0, seed=7,
                                          extra_body={"ignore_eos": True})
    assert sorted(c.index for c in chat.choices) == [0, 1]
    assert chat.usage.completion_tokens == 8
    streamed = {}
    for chunk in client.completions.create(model=server.model, prompt=PROMPT, max_tokens=6, n=2,
                                           temperature=1.0, seed=7, stream=True,
                                           extra_body={"ignore_eos": True}):
        for c in chunk.choices:
            streamed[c.index] = streamed.get(c.index, "") + c.text
    assert sorted(streamed) == [0, 1]


def test_stop_string_cuts_the_text(client, server):
    kw = dict(model=server.model, prompt=PROMPT, temperature=0, extra_body={"ignore_eos": True})
    full = client.completions.create(max_tokens=16, **kw).choices[0].text
    stop = next(full[i:i + 2] for i in range(2, len(full) - 1) if full[i:i + 2].strip())
    r = client.completions.create(max_tokens=16, stop=[stop], **kw)
    assert r.choices[0].text == full[:full.index(stop)]
    assert r.choices[0].finish_reason == "stop"


def test_seed_reproducible(client, server):
    kw = dict(model=server.model, prompt=PROMPT, max_tokens=12, temperature=1.0,
              extra_body={"ignore_eos": True})
    a = client.completions.create(seed=1234, **kw).choices[0].text
    b = client.completions.create(seed=1234, **kw).choices[0].text
    assert a == b
    others = {client.completions.create(seed=s, **kw).choices[0].text for s in (1, 2, 3)}
    assert len(others | {a}) > 1, "sampling ignored the seed: every seed gave the same text"


def test_echo_returns_prompt_then_completion(client, server):
    kw = dict(model=server.model, prompt=PROMPT, max_tokens=4, temperature=0,
              extra_body={"ignore_eos": True})
    plain = client.completions.create(**kw).choices[0].text
    echoed = client.completions.create(echo=True, **kw).choices[0].text
    assert echoed == PROMPT + plain


def test_vllm_extras_are_accepted(client, server):
    r = client.completions.create(model=server.model, prompt=PROMPT, max_tokens=6, temperature=0.8,
                                  seed=3, extra_body={"top_k": 5, "min_p": 0.05,
                                                      "repetition_penalty": 1.2, "min_tokens": 6,
                                                      "stop_token_ids": [1]})
    # min_tokens = max_tokens: the EOS / stop tokens are suppressed until the end
    assert r.usage.completion_tokens == 6 and r.choices[0].finish_reason == "length"
