"""Streams are built from the engine's DELTA outputs: joined back together they equal the
non-streaming answer (which comes from FINAL_ONLY outputs) — text, logprobs, finish reasons and
usage — with n > 1 (one choice a chunk, as OpenAI's and vLLM's), several prompts, stop strings,
echo and multi-byte text."""
from __future__ import annotations

import pytest

# The second request of a pair hits the prefix cache, which runs the prompt in other shapes:
# logprobs then agree to float32 rounding, tokens and text exactly.
TOL = 1e-4

PROMPTS = ["Привет, мир! 日本語 🚀 and", "The quick brown fox jumps over"]


def _stop_from(text: str) -> str:
    """A 3-character stop string from the middle of a text (likely spanning a token boundary)."""
    return next(text[i:i + 3] for i in range(3, len(text) - 3)
                if text[i:i + 3].strip() and "\ufffd" not in text[i:i + 3])


def _join_completion_stream(chunks):
    joined: dict[int, dict] = {}
    usage = None
    for chunk in chunks:
        if chunk.usage is not None:
            usage = chunk.usage
        assert len(chunk.choices) <= 1, "one choice a chunk, as OpenAI's and vLLM's streams"
        for c in chunk.choices:
            j = joined.setdefault(c.index, {"text": "", "tokens": [], "token_logprobs": [], "finish": []})
            assert not j["finish"], "a choice streamed on after its finish_reason"
            j["text"] += c.text
            if c.logprobs is not None:
                j["tokens"] += c.logprobs.tokens
                j["token_logprobs"] += c.logprobs.token_logprobs
            if c.finish_reason is not None:
                j["finish"].append(c.finish_reason)
    return joined, usage


@pytest.mark.parametrize("n,temperature", [(1, 0.0), (2, 1.0)])
def test_completion_stream_joins_to_the_response(client, server, n, temperature):
    base = client.completions.create(model=server.model, prompt=PROMPTS[0], max_tokens=24, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text
    kw = dict(model=server.model, prompt=PROMPTS, max_tokens=24, n=n, temperature=temperature, seed=5,
              logprobs=2, stop=[_stop_from(base), "never-seen-stop-xyz"], extra_body={"ignore_eos": True})
    full = client.completions.create(**kw)
    joined, usage = _join_completion_stream(
        client.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    assert sorted(joined) == sorted(c.index for c in full.choices) == list(range(2 * n))
    for c in full.choices:
        j = joined[c.index]
        assert j["text"] == c.text
        assert j["tokens"] == c.logprobs.tokens
        assert j["token_logprobs"] == pytest.approx(c.logprobs.token_logprobs, abs=TOL)
        assert j["finish"] == [c.finish_reason]
    assert usage.completion_tokens == full.usage.completion_tokens
    assert usage.prompt_tokens == full.usage.prompt_tokens
    assert any(not c.text.isascii() for c in full.choices)
    if temperature == 0.0:  # greedy repeats base, so its stop string is met
        assert full.choices[0].finish_reason == "stop" and base.startswith(full.choices[0].text)


def test_completion_stream_with_echo(client, server):
    kw = dict(model=server.model, prompt=PROMPTS, max_tokens=8, n=2, temperature=1.0, seed=9, echo=True,
              extra_body={"ignore_eos": True})
    full = client.completions.create(**kw)
    joined, _ = _join_completion_stream(client.completions.create(stream=True, **kw))
    for c in full.choices:
        assert c.text.startswith(PROMPTS[c.index // 2])
        assert joined[c.index]["text"] == c.text


def test_chat_stream_joins_to_the_response(client, server):
    messages = [{"role": "user", "content": PROMPTS[0]}]
    base = client.chat.completions.create(model=server.model, messages=messages, max_tokens=24,
                                          temperature=0, extra_body={"ignore_eos": True})
    kw = dict(model=server.model, messages=messages, max_tokens=24, n=3, temperature=1.0, seed=3,
              logprobs=True, top_logprobs=2, stop=[_stop_from(base.choices[0].message.content)],
              extra_body={"ignore_eos": True})
    full = client.chat.completions.create(**kw)
    joined: dict[int, dict] = {}
    usage = None
    for chunk in client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw):
        usage = chunk.usage or usage
        assert len(chunk.choices) <= 1, "one choice a chunk, as OpenAI's and vLLM's streams"
        for c in chunk.choices:
            j = joined.setdefault(c.index, {"text": "", "logprobs": [], "finish": []})
            assert not j["finish"]
            j["text"] += c.delta.content or ""
            if c.logprobs is not None:
                j["logprobs"] += c.logprobs.content
            if c.finish_reason is not None:
                j["finish"].append(c.finish_reason)
    assert sorted(joined) == [0, 1, 2]
    for c in full.choices:
        j = joined[c.index]
        assert j["text"] == c.message.content
        assert [t.token for t in j["logprobs"]] == [t.token for t in c.logprobs.content]
        assert [t.logprob for t in j["logprobs"]] == \
            pytest.approx([t.logprob for t in c.logprobs.content], abs=TOL)
        assert [[x.token for x in t.top_logprobs] for t in j["logprobs"]] == \
            [[x.token for x in t.top_logprobs] for t in c.logprobs.content]
        assert j["finish"] == [c.finish_reason]
    assert usage.completion_tokens == full.usage.completion_tokens


def test_stream_metrics_count_delta_tokens_once(client, server):
    """The server's token counters and latency histograms add up DELTA outputs exactly."""
    before = server.metrics()
    joined, usage = _join_completion_stream(client.completions.create(
        model=server.model, prompt=PROMPTS[1], max_tokens=9, n=3, temperature=1.0, seed=1, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    after = server.metrics()
    assert usage.completion_tokens == 27 and len(joined) == 3

    def delta(name):
        return after["pagedserve:" + name] - before["pagedserve:" + name]
    assert delta("generation_tokens_total") == 27
    assert delta("prompt_tokens_total") == usage.prompt_tokens
    for h in ("time_to_first_token_seconds", "time_per_output_token_seconds"):
        assert delta(h + "_count") == 1 and delta(h + "_sum") > 0


def test_stop_reason_names_what_stopped_each_choice(http):
    """vLLM's stop_reason beside finish_reason in every choice (completions and chat, streamed
    and not): the stop token id or stop string that ended it, null for EOS or the length."""
    import json

    def last_choice(path, body):
        r = http.post(path, json={"model": "tiny", "temperature": 0, **body})
        assert r.status_code == 200, r.text
        whole = r.json()["choices"][0]
        with http.stream("POST", path, json={"model": "tiny", "temperature": 0, "stream": True, **body}) as s:
            chunks = [json.loads(line[6:]) for line in s.iter_lines()
                      if line.startswith("data: {")]
        streamed = [c["choices"][0] for c in chunks if c["choices"]]
        assert all("stop_reason" in c for c in streamed)
        return whole, streamed[-1]

    for path, base in (("/v1/completions", {"prompt": PROMPTS[1]}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": PROMPTS[1]}]})):
        free, _ = last_choice(path, {**base, "max_tokens": 8, "return_tokens_as_token_ids": True,
                                     "logprobs": 1 if "prompt" in base else True})
        assert free["finish_reason"] == "length" and free["stop_reason"] is None
        names = free["logprobs"]["tokens"] if "prompt" in base else [t["token"] for t in free["logprobs"]["content"]]
        first = int(names[0].removeprefix("token_id:"))
        whole, streamed = last_choice(path, {**base, "max_tokens": 8, "stop_token_ids": [first]})
        assert (whole["finish_reason"], whole["stop_reason"]) == ("stop", first)
        assert (streamed["finish_reason"], streamed["stop_reason"]) == ("stop", first)
        text = free["text"] if "prompt" in base else free["message"]["content"]
        stop = _stop_from(text)
        whole, streamed = last_choice(path, {**base, "max_tokens": 8, "stop": [stop]})
        assert whole["stop_reason"] == streamed["stop_reason"] == stop and whole["finish_reason"] == "stop"
