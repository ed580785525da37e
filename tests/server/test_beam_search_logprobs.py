"""Logprobs of a beam search on the server, as vLLM 0.26 serves them: each choice's tokens with
the logprobs of the steps that produced them (LLM.beam_search's BeamSearchSequence.logprobs,
HF's log_softmax), written as a sampled request's are: completions' chosen token first then the
top k; chat's logprob and top_logprobs per token, streamed and not."""
from __future__ import annotations

import itertools
import json

import pytest
import torch

from beam_server import CHAT, CMPL, chat_prompt, expected, post
from beam_server import http, llm, model, server  # noqa: F401 (fixtures)
from engine.helpers import hf_model, prompt_ids

TOL = 1e-4  # the server's, offline's and HF's float32 logits differ by reduction order and batch


def hf_logp(model_dir, ids):
    """HF's float32 log_softmax after every position of ids."""
    with torch.no_grad():
        return torch.log_softmax(hf_model(str(model_dir))(torch.tensor([ids])).logits[0].float(), -1)


def visible(s, include_stop=False):
    """The hypothesis' tokens a choice reports (vLLM's server leaves a "stop" EOS out unless
    include_stop_str_in_output), with their offline dicts."""
    n = len(s.output_tokens) - (s.finish_reason == "stop" and not include_stop)
    return s.output_tokens[:n], s.logprobs[:n]


def completion_top(d, chosen, k):
    """A completions position as OpenAI's and vLLM's: the chosen token first, then the top k, by name."""
    top = {d[chosen].decoded_token: d[chosen].logprob}
    for v in itertools.islice(d.values(), k):
        top[v.decoded_token] = v.logprob  # two tokens of one name are one entry, as in vLLM
    return top


@pytest.mark.parametrize("n,k,include_stop", [(3, 3, False), (2, 5, True)])
def test_completions_logprobs_are_the_hypotheses(http, model, llm, n, k, include_stop):
    """logprobs k with use_beam_search: per choice and token, its name, the logprob its beam's
    score summed, the step's top k (more than the 2n candidates too) after it, text_offset; the
    values HF's. A "stop" hypothesis' EOS and its logprobs only with include_stop_str_in_output."""
    prompts = prompt_ids(model[0])[:2]
    body = post(http, CMPL, prompt=prompts, n=n, max_tokens=8, use_beam_search=True, logprobs=k,
                include_stop_str_in_output=include_stop)
    stopped = 0
    for i, p in enumerate(prompts):
        out, _ = expected(model, llm, p, n, 8, logprobs=k)  # its dicts hold the top k too
        for c, s in zip(body["choices"][i * n:(i + 1) * n], out.sequences):
            lp, (tokens, dicts) = c["logprobs"], visible(s, include_stop)
            assert lp["tokens"] == [d[t].decoded_token for t, d in zip(tokens, dicts)]
            assert lp["token_logprobs"] == pytest.approx([d[t].logprob for t, d in zip(tokens, dicts)], abs=TOL)
            if len(tokens) == len(s.output_tokens):  # every token reported: their sum is the beam's
                assert sum(lp["token_logprobs"]) == pytest.approx(s.cum_logprob, abs=TOL * len(tokens))
            assert len(lp["top_logprobs"]) == len(tokens)
            ref = hf_logp(model[0], p + s.output_tokens)
            for j, (t, d, top) in enumerate(zip(tokens, dicts, lp["top_logprobs"])):
                want = completion_top(d, t, k)
                assert list(top) == list(want)
                assert list(top.values()) == pytest.approx(list(want.values()), abs=TOL)
                hf = ref[len(p) - 1 + j].topk(k)
                assert lp["token_logprobs"][j] == pytest.approx(float(ref[len(p) - 1 + j][t]), abs=TOL)
                assert list(itertools.islice(d, k)) == hf.indices.tolist()  # what `want` took its top k from
                assert [v.logprob for v in itertools.islice(d.values(), k)] == pytest.approx(hf.values.tolist(),
                                                                                            abs=TOL)
            offsets = itertools.accumulate((len(x) for x in lp["tokens"]), initial=0)
            assert lp["text_offset"] == list(offsets)[:len(tokens)]
            stopped += s.finish_reason == "stop"
    assert stopped


def test_chat_logprobs_streamed_or_not(http, model, llm):
    """logprobs + top_logprobs 2 with use_beam_search on chat: each choice's content logprobs, token
    by token, the hypothesis' (HF's values), the top 2 in rank order; streamed, each choice's content
    chunk carries them, the same."""
    messages = [{"role": "user", "content": "Paged attention stores the KV cache"}]
    ids = chat_prompt(http, messages)
    out, _ = expected(model, llm, ids, 3, 7)
    req = dict(messages=messages, n=3, max_completion_tokens=7, use_beam_search=True, logprobs=True, top_logprobs=2)
    body = post(http, CHAT, **req)
    with http.stream("POST", CHAT, json={"model": "tiny", **req, "stream": True}) as r:
        assert r.status_code == 200
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    streamed: dict[int, list] = {}
    for e in events:
        (c,) = e["choices"]
        if c["delta"].get("role"):
            assert c["logprobs"] is None
        else:
            streamed.setdefault(c["index"], []).extend(c["logprobs"]["content"])
    for c, s in zip(body["choices"], out.sequences):
        tokens, dicts = visible(s)
        content = c["logprobs"]["content"]
        ref = hf_logp(model[0], ids + s.output_tokens)
        assert [x["token"] for x in content] == [d[t].decoded_token for t, d in zip(tokens, dicts)]
        for j, (x, t, d) in enumerate(zip(content, tokens, dicts)):
            assert x["logprob"] == pytest.approx(d[t].logprob, abs=TOL)
            assert x["logprob"] == pytest.approx(float(ref[len(ids) - 1 + j][t]), abs=TOL)
            assert x["bytes"] == list(x["token"].encode())
            top = list(d.values())[:2]
            assert [y["token"] for y in x["top_logprobs"]] == [v.decoded_token for v in top]
            assert [y["logprob"] for y in x["top_logprobs"]] == pytest.approx([v.logprob for v in top], abs=TOL)
        got = streamed[c["index"]]
        assert [(x["token"], x["bytes"], [y["token"] for y in x["top_logprobs"]]) for x in got] == \
            [(x["token"], x["bytes"], [y["token"] for y in x["top_logprobs"]]) for x in content]
        assert [x["logprob"] for x in got] == pytest.approx([x["logprob"] for x in content], abs=TOL)
