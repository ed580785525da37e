"""A real `pagedserve serve` process on a tiny model, started once per session."""
from __future__ import annotations

import httpx
import pytest

from server_process import API_KEY, BLOCK_SIZE, MAX_MODEL_LEN, NUM_BLOCKS, start_server, stop_server


@pytest.fixture(scope="session")
def server(tiny_model_dir, tmp_path_factory):
    """The shared server: API key on, a small KV pool, max_model_len 512."""
    log = tmp_path_factory.mktemp("server") / "server.log"
    s = start_server(tiny_model_dir("llama"), log,
                     "--max-model-len", str(MAX_MODEL_LEN), "--block-size", str(BLOCK_SIZE),
                     "--num-gpu-blocks-override", str(NUM_BLOCKS), "--max-num-seqs", "128",
                     "--swap-space", "0.05", "--max-request-bytes", "65536", api_key=API_KEY)
    yield s
    stop_server(s)
    assert s.proc.returncode is not None


@pytest.fixture(scope="session")
def client(server):
    import openai
    return openai.OpenAI(base_url=server.v1, api_key=server.api_key, max_retries=0, timeout=120)


@pytest.fixture(scope="session")
def http(server):
    with httpx.Client(base_url=server.base_url, headers=server.headers, timeout=120) as c:
        yield c


@pytest.fixture(scope="session")
def hf_model(server):
    """The same checkpoint in HF transformers: the reference for greedy tokens and logprobs."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    model = AutoModelForCausalLM.from_pretrained(server.model_dir, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(server.model_dir)
    return model, tok
