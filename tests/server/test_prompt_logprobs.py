"""vLLM's prompt_logprobs request field on the server: /v1/completions answers it in each choice,
/v1/chat/completions at the top of the response, as vLLM 0.26 does; values, ranks and token
names against HF transformers; at most --max-logprobs; refused with stream."""
import httpx
import pytest
import torch

from logprob_reference import rank_band, vllm_name
from server_process import start_server, stop_server

TEXT = "Hi 🚀 there, Привет"
TOL = 1e-4


def _check(plp, ids, k, hf_model):
    """vLLM's shape: one entry per prompt token, null first; token id (a string in JSON) ->
    {logprob, rank, decoded_token}, the prompt's own token first, then the top k ranked 1..k."""
    model, tok = hf_model
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1)
    assert len(plp) == len(ids) and plp[0] is None
    for j in range(1, len(ids)):
        entry, ref = plp[j], logp[j - 1]
        assert list(entry)[0] == str(ids[j])
        assert {int(t) for t in entry} == set(ref.topk(k).indices.tolist()) | {ids[j]}
        for t, v in entry.items():
            assert set(v) == {"logprob", "rank", "decoded_token"}
            assert abs(v["logprob"] - ref[int(t)].item()) < TOL
            lo, hi = rank_band(ref, int(t), TOL)
            assert lo <= v["rank"] <= hi, (j, t, v, lo, hi)
            assert v["decoded_token"] == vllm_name(tok, int(t), ids[max(1, j - 4):j])
        tops = sorted(v["rank"] for t, v in entry.items() if int(t) != ids[j] or v["rank"] <= k)
        assert tops == list(range(1, k + 1))


def test_completions_prompt_logprobs_in_each_choice(http, server, hf_model):
    ids = hf_model[1].encode(TEXT)
    r = http.post("/v1/completions", json={"model": server.model, "prompt": ids, "max_tokens": 2,
                                           "n": 2, "temperature": 1.0, "prompt_logprobs": 3})
    assert r.status_code == 200, r.text
    choices = r.json()["choices"]
    assert len(choices) == 2 and choices[0]["prompt_logprobs"] == choices[1]["prompt_logprobs"]
    _check(choices[0]["prompt_logprobs"], ids, 3, hf_model)
    # Not asked for (echo + logprobs computes them too): the response is as before, no such key.
    r = http.post("/v1/completions", json={"model": server.model, "prompt": ids, "max_tokens": 2,
                                           "echo": True, "logprobs": 1})
    assert r.status_code == 200 and "prompt_logprobs" not in r.json()["choices"][0]


def test_chat_prompt_logprobs_at_the_top(http, server, hf_model):
    messages = [{"role": "user", "content": TEXT}]
    r = http.post("/v1/chat/completions", json={"model": server.model, "max_tokens": 2, "prompt_logprobs": 2,
                                                "messages": messages})
    assert r.status_code == 200, r.text
    body = r.json()
    assert "prompt_logprobs" not in body["choices"][0]
    ids = http.post("/tokenize", json={"model": server.model, "messages": messages}).json()["tokens"]
    assert len(ids) == body["usage"]["prompt_tokens"]
    _check(body["prompt_logprobs"], ids, 2, hf_model)


@pytest.mark.parametrize("path,extra", [("/v1/completions", {"prompt": "hi"}),
                                        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})])
def test_prompt_logprobs_limit_and_stream(http, server, path, extra):
    body = {"model": server.model, "max_tokens": 2, **extra}
    r = http.post(path, json={**body, "prompt_logprobs": 21})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err == {**err, "param": "prompt_logprobs",
                   "message": "prompt_logprobs must be <= 20 (the server's --max-logprobs), got 21"}
    assert http.post(path, json={**body, "prompt_logprobs": 20}).status_code == 200
    r = http.post(path, json={**body, "prompt_logprobs": 1, "stream": True})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt_logprobs"
    assert "`prompt_logprobs` are not available when `stream=True`." in r.json()["error"]["message"]
    with http.stream("POST", path, json={**body, "prompt_logprobs": 0, "stream": True}) as r:
        assert r.status_code == 200 and "prompt_logprobs" not in r.read().decode()


def test_minus_one_is_the_whole_vocabulary_under_max_logprobs_minus_one(tiny_model_dir, tmp_path, hf_model):
    """vLLM's -1 for prompt_logprobs (both endpoints) and chat's top_logprobs: every token of the
    vocabulary, once the server allows it (--max-logprobs -1; under a bound it is a 400 naming
    the field, tests/server/test_server_flags.py)."""
    model, tok = hf_model
    server = start_server(tiny_model_dir("llama"), tmp_path / "server.log", "--max-model-len", "256",
                          "--num-gpu-blocks-override", "64", "--max-logprobs", "-1")
    try:
        with httpx.Client(base_url=server.base_url, timeout=120) as c:
            ids = tok.encode(TEXT)
            r = c.post("/v1/completions", json={"model": "tiny", "prompt": ids, "max_tokens": 1,
                                                "prompt_logprobs": -1})
            assert r.status_code == 200, r.text
            vocab = model.config.vocab_size
            _check(r.json()["choices"][0]["prompt_logprobs"], ids, vocab, hf_model)
            messages = [{"role": "user", "content": TEXT}]
            r = c.post("/v1/chat/completions", json={"model": "tiny", "messages": messages, "max_tokens": 2,
                                                     "temperature": 0, "logprobs": True, "top_logprobs": -1})
            assert r.status_code == 200, r.text
            content = r.json()["choices"][0]["logprobs"]["content"]
            prompt = c.post("/tokenize", json={"model": "tiny", "messages": messages}).json()["tokens"]
            with torch.no_grad():
                logp = torch.log_softmax(model(torch.tensor([prompt])).logits[0, -1].float(), -1)
            assert len(content) == 2 and all(len(step["top_logprobs"]) == vocab for step in content)
            got = [e["logprob"] for e in content[0]["top_logprobs"]]  # the most likely first, as OpenAI's
            assert got == pytest.approx(sorted(logp.tolist(), reverse=True), abs=TOL)
    finally:
        stop_server(server)
