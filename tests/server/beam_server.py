"""The server beam-search tests' fixtures and references: a server on the tiny llama with a
second EOS, LLM.beam_search beside it, HF's num_beams (each test module starts its own server)."""
from __future__ import annotations

import json

import httpx
import pytest
import torch

from engine.helpers import hf_greedy, hf_model, make_llm, prompt_ids, tokenizer
from pagedserve import BeamSearchParams
from server_process import start_server, stop_server

MAX_NUM_SEQS = 16
CMPL, CHAT = "/v1/completions", "/v1/chat/completions"


@pytest.fixture(scope="module")
def model(tiny_model_dir, tmp_path_factory):
    """The tiny llama with a second EOS, a token its greedy run emits early on (as the engine's
    beam test does): hypotheses end at different lengths, so the length penalty matters."""
    base = tiny_model_dir("llama")
    eos = hf_greedy(base, prompt_ids(base)[0], 3)[2]
    d = tmp_path_factory.mktemp("beam-model")
    for f in base.iterdir():
        if f.name != "generation_config.json":
            (d / f.name).symlink_to(f)
    gen = json.loads((base / "generation_config.json").read_text())
    (d / "generation_config.json").write_text(json.dumps({**gen, "eos_token_id": [gen["eos_token_id"], eos]}))
    return d, [gen["eos_token_id"], eos]


@pytest.fixture(scope="module")
def server(model, tmp_path_factory):
    s = start_server(model[0], tmp_path_factory.mktemp("beam-server") / "server.log", "--max-model-len", "256",
                     "--block-size", "4", "--num-gpu-blocks-override", "512",
                     "--max-num-seqs", str(MAX_NUM_SEQS), "--swap-space", "0.05")
    yield s
    stop_server(s)


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.base_url, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def llm(model):
    return make_llm(model[0], block_size=4)


def hf_beams(model_dir, prompt, eos_ids, k, max_new, length_penalty):
    """HF generate(num_beams=k, early_stopping=True): each hypothesis' tokens up to its EOS, best first."""
    with torch.no_grad():
        out = hf_model(str(model_dir)).generate(
            torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long), do_sample=False,
            num_beams=k, early_stopping=True, length_penalty=length_penalty, num_return_sequences=k,
            max_new_tokens=max_new, pad_token_id=2, eos_token_id=eos_ids)
    beams = []
    for seq in out:
        toks = seq[len(prompt):].tolist()
        end = next((i for i, t in enumerate(toks) if t in eos_ids), None)
        beams.append(toks if end is None else toks[:end + 1])
    return beams


def expected(model, llm, prompt, n, max_tokens, length_penalty=1.0, include_stop=False, **kw):
    """The choices vLLM's server makes of LLM.beam_search's hypotheses: (text, finish_reason,
    token count), the EOS in neither text nor count unless include_stop_str_in_output."""
    kw.setdefault("temperature", 1.0)  # a request's unset temperature (the tiny model's config has none)
    out = llm.beam_search({"prompt_token_ids": prompt}, BeamSearchParams(
        beam_width=n, max_tokens=max_tokens, length_penalty=length_penalty, **kw))[0]
    tok = tokenizer(str(model[0]))
    res = []
    for s in out.sequences:
        ids = s.output_tokens[:-1] if s.finish_reason == "stop" else s.output_tokens
        res.append((tok.decode(ids, skip_special_tokens=True), s.finish_reason,
                    len(s.output_tokens) if include_stop else len(ids)))
    return out, res


def post(http, path, **body):
    r = http.post(path, json={"model": "tiny", **body})
    assert r.status_code == 200, r.text
    return r.json()


def chat_prompt(http, messages):
    return http.post("/tokenize", json={"model": "tiny", "messages": messages}).json()["tokens"]
