"""/v1/completions with echo + logprobs (lm-evaluation-harness's scoring call): the echoed prompt's
token logprobs are HF's, the first is null, max_tokens 0 returns the prompt alone, and a stream
carries the prompt's logprobs in its first chunk."""
import torch

PROMPT_IDS = [0, 17, 42, 99, 5, 250, 31, 8, 64, 120]


def _hf_prompt_logprobs(hf_model, ids):
    model, _ = hf_model
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1)
    return [None] + [logp[i - 1, ids[i]].item() for i in range(1, len(ids))], logp


def test_echo_logprobs_max_tokens_0_scores_the_prompt(http, server, hf_model):
    r = http.post("/v1/completions", json={"model": server.model, "prompt": PROMPT_IDS, "max_tokens": 0,
                                           "echo": True, "logprobs": 2, "temperature": 0})
    assert r.status_code == 200, r.text
    body = r.json()
    choice = body["choices"][0]
    lp = choice["logprobs"]
    want, logp = _hf_prompt_logprobs(hf_model, PROMPT_IDS)
    assert len(lp["tokens"]) == len(PROMPT_IDS) and lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    for got, ref in zip(lp["token_logprobs"][1:], want[1:]):
        assert abs(got - ref) < 1e-4, (got, ref)
    for pos in range(1, len(PROMPT_IDS)):
        # keyed by token text, so tokens that decode alike share a key: each value is one of HF's top 2
        allowed = logp[pos - 1].topk(2).values.tolist() + [want[pos]]
        assert all(min(abs(v - a) for a in allowed) < 1e-4 for v in lp["top_logprobs"][pos].values())
    assert body["usage"]["completion_tokens"] == 0 and choice["finish_reason"] == "length"


def test_echo_logprobs_with_a_completion_and_streamed(http, server, hf_model):
    kw = {"model": server.model, "prompt": PROMPT_IDS, "max_tokens": 3, "echo": True, "logprobs": 1,
          "temperature": 0}
    body = http.post("/v1/completions", json=kw).json()
    lp = body["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == len(PROMPT_IDS) + 3
    want, _ = _hf_prompt_logprobs(hf_model, PROMPT_IDS)
    assert all(abs(g - w) < 1e-4 for g, w in zip(lp["token_logprobs"][1:len(PROMPT_IDS)], want[1:]))
    import json
    chunks = []
    with http.stream("POST", "/v1/completions", json={**kw, "stream": True}) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[6:]))
    streamed = [t for c in chunks for ch in c["choices"] for t in ch["logprobs"]["token_logprobs"]]
    assert streamed[0] is None and len(streamed) == len(lp["token_logprobs"])
    assert all(a is None and b is None or abs(a - b) < 1e-5 for a, b in zip(streamed, lp["token_logprobs"]))
