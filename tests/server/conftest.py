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


# The demo model's chat template, taught tools the Hermes way (the bundled one refuses the tool
# role and ignores tools): the tool-calling server tests render through it.
TOOLS_CHAT_TEMPLATE = (
    "{{ bos_token }}{% if tools %}<|system|>\nYou may call these functions:\n"
    "{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}"
    "Call one as <tool_call>{\"name\": ..., \"arguments\": ...}</tool_call>{{ eos_token }}\n{% endif %}"
    "{% for message in messages %}"
    "<|{{ 'user' if message['role'] == 'tool' else message['role'] }}|>\n"
    "{% if message['role'] == 'tool' %}<tool_response>{{ message['content'] }}</tool_response>"
    "{% else %}{{ message['content'] }}{% endif %}"
    "{% if message.tool_calls %}{% for tc in message.tool_calls %}<tool_call>{\"name\": "
    "{{ tc['function']['name'] | tojson }}, \"arguments\": {{ tc['function']['arguments'] | tojson }}}"
    "</tool_call>{% endfor %}{% endif %}{{ eos_token }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")


@pytest.fixture(scope="session")
def tools_model_dir(tmp_path_factory):
    """The demo model (its files linked) with TOOLS_CHAT_TEMPLATE."""
    import json

    from pagedserve.demo_model import DEMO_MODEL_DIR
    d = tmp_path_factory.mktemp("tools-model")
    for f in DEMO_MODEL_DIR.iterdir():
        if f.suffix in (".json", ".safetensors") and f.name != "tokenizer_config.json":
            (d / f.name).symlink_to(f)
    cfg = json.loads((DEMO_MODEL_DIR / "tokenizer_config.json").read_text())
    cfg["chat_template"] = TOOLS_CHAT_TEMPLATE
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    return d


@pytest.fixture(scope="session")
def tools_server(tmp_path_factory):
    """The demo model with tool calling (hermes) and a reasoning parser (qwen3) switched on, and
    TOOLS_CHAT_TEMPLATE given by --chat-template (tools_model_dir holds it in its tokenizer's
    config: HF's rendering there is the reference for the server's)."""
    from pagedserve.demo_model import DEMO_MODEL_DIR
    folder = tmp_path_factory.mktemp("tools-server")
    (folder / "tools.jinja").write_text(TOOLS_CHAT_TEMPLATE)
    s = start_server(DEMO_MODEL_DIR, folder / "server.log", "--chat-template", str(folder / "tools.jinja"),
                     "--max-model-len", "1024", "--block-size", "16",
                     "--num-gpu-blocks-override", "256", "--max-num-seqs", "32",
                     "--swap-space", "0.05", "--enable-auto-tool-choice",
                     "--tool-call-parser", "hermes", "--reasoning-parser", "qwen3")
    yield s
    stop_server(s)


@pytest.fixture(scope="session")
def tools_client(tools_server):
    import openai
    return openai.OpenAI(base_url=tools_server.v1, api_key="x", max_retries=0, timeout=120)


@pytest.fixture(scope="session")
def tools_http(tools_server):
    with httpx.Client(base_url=tools_server.base_url, timeout=120) as c:
        yield c
