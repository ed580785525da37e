"""Shared helpers for the engine tests: HF references and engine construction."""
from __future__ import annotations

import functools

import torch

from pagedserve.entrypoints.llm import LLM

# Mixed lengths, several blocks long at block_size 8 or 16, a shared prefix, multi-byte text.
PROMPT_TEXTS = [
    "The quick brown fox",
    "Paged attention stores the KV cache in fixed-size blocks, like pages of virtual memory.",
    "Hi",
    "Привет, мир! Как дела?",
    "def main():\n    print('hello, world')",
    "A block table maps logical blocks to physical blocks; copy-on-write shares them. "
    "Continuous batching lets requests join and leave the batch at every step.",
    "日本語のテキスト 🚀🔥",
    "Numbers: 0 1 2 3 4 5 6 7 8 9 10 100 1000",
    "Paged attention stores the KV cache in fixed-size blocks, like pages",
]


@functools.lru_cache(maxsize=8)
def hf_model(model_dir: str):
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32)
    model.eval()
    return model


@functools.lru_cache(maxsize=8)
def tokenizer(model_dir: str):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(model_dir)


def prompt_ids(model_dir: str) -> list[list[int]]:
    tok = tokenizer(str(model_dir))
    return [tok.encode(t) for t in PROMPT_TEXTS]


_hf_cache: dict = {}


def hf_greedy(model_dir, prompt: list[int], max_new_tokens: int, ignore_eos: bool = False) -> list[int]:
    """HF generate(do_sample=False) on one unpadded prompt: the generated tokens."""
    key = (str(model_dir), tuple(prompt), max_new_tokens, ignore_eos)
    if key not in _hf_cache:
        model = hf_model(str(model_dir))
        kw = dict(do_sample=False, max_new_tokens=max_new_tokens, pad_token_id=2)
        if ignore_eos:
            kw["eos_token_id"] = None
            kw["suppress_tokens"] = None
        with torch.no_grad():
            out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                                 **kw)
        _hf_cache[key] = out[0, len(prompt):].tolist()
    return _hf_cache[key]


def make_llm(model_dir, **kw) -> LLM:
    kw.setdefault("device", "cpu")
    kw.setdefault("dtype", "float32")
    kw.setdefault("swap_space", 0.01)
    kw.setdefault("num_gpu_blocks_override", 512)
    return LLM(str(model_dir), **kw)


def assert_no_leak(llm: LLM) -> None:
    stats = llm.get_kv_cache_stats()
    assert stats.num_blocks_used == 0, stats
    assert stats.num_swapped_blocks == 0, stats
    assert not llm.llm_engine.has_unfinished_requests()


def add_fork_beam_mix(engine, ids: list[list[int]], max_tokens: int, fork_seed: int | None = None) -> None:
    """A mix that shares and swaps blocks in a small cache: "fork" (n=3), "beam" (width 3) and
    six seeded sampled requests "r0".."r5" of max_tokens each."""
    from pagedserve import BeamSearchParams, SamplingParams
    long = SamplingParams(temperature=1.0, max_tokens=max_tokens, ignore_eos=True, seed=1)
    engine.add_request("fork", {"prompt_token_ids": ids[1]},
                       SamplingParams(n=3, temperature=1.0, max_tokens=max_tokens, ignore_eos=True, seed=fork_seed))
    engine.add_beam_search_request("beam", {"prompt_token_ids": ids[0]},
                                   BeamSearchParams(beam_width=3, max_tokens=max_tokens, ignore_eos=True))
    for i, p in enumerate(ids[2:8]):
        engine.add_request(f"r{i}", {"prompt_token_ids": p}, long)


def fork_is_forked(engine) -> bool:
    return engine.has_request("fork") and len(engine._groups["fork"].seqs) == 3


def model_with_generation_config(folder, **values):
    """The demo model's files linked into folder, with a generation_config.json of its own."""
    import json

    from pagedserve.demo_model import DEMO_MODEL_DIR
    for f in DEMO_MODEL_DIR.iterdir():
        if f.suffix in (".json", ".safetensors") and f.name != "generation_config.json":
            (folder / f.name).symlink_to(f)
    base = json.loads((DEMO_MODEL_DIR / "generation_config.json").read_text())
    (folder / "generation_config.json").write_text(json.dumps({**base, **values}))
    return folder


def puppet_core(before_ready: str = "") -> str:
    """`python -c` source of a puppet engine core for MPCoreClient's tests: its real sockets, no
    model. It runs `before_ready` (a test's hold, Python at top level), sends Ready and then only
    waits for Shutdown. PYTHONPATH must reach pagedserve."""
    return f"""
import os, sys, time, zmq
from pagedserve.engine.core_messages import Codec, Ready, Shutdown
{before_ready}
a = sys.argv[1:]
ctx = zmq.Context()
inp, out = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
inp.connect(a[a.index("--input") + 1])
out.connect(a[a.index("--output") + 1])
codec = Codec()
out.send(codec.encode(Ready(0, 64, 100, 8, 0, 16, 8, [2])))
while not any(isinstance(op, Shutdown) for op in codec.inputs.decode(inp.recv()).ops):
    pass
"""
