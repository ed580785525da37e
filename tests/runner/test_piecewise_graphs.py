"""Piecewise graphs on CPU: the real splitting, static buffers, padding and attention hook, with a
recorder standing in for torch.cuda.CUDAGraph (tests/recorded_graph.py: replays re-run the recorded
ops on the recorded tensors). A tiny Llama driven through mixed prefill + decode steps must give
exactly the logits and KV cache of the plain eager runner, padded bucket or not. (Padding changes
the row count of every GEMM; on CPU rows come out bit-identical from 8 rows on, which every
piecewise step here has: decode-only steps, the short ones, never take the piecewise path.)"""
import argparse
import random

import pytest
import torch

from pagedserve.config import EngineConfig
from pagedserve.engine_args import add_engine_args, engine_config_from_args
from pagedserve.runner.piecewise_graphs import MAX_PIECEWISE_TOKENS, PiecewiseCUDAGraphs, token_buckets
from paged_harness import Lockstep, make_runner
from recorded_graph import RecordedGraph

MAX_TOKENS = 64  # buckets 16, 32, 48, 64


def test_token_buckets():
    b = token_buckets(8192)
    assert b == sorted(set(b)) and b[0] == 16 and b[-1] == MAX_PIECEWISE_TOKENS and len(b) == 28
    assert token_buckets(MAX_TOKENS) == [16, 32, 48, 64]
    assert token_buckets(100) == [16, 32, 48, 64, 80, 96, 100]
    assert token_buckets(8) == [8]
    assert token_buckets(8192, cap=2048) == b + [1280, 1536, 1792, 2048]
    assert token_buckets(1500, cap=2048) == b + [1280, 1500]


def test_the_cap_comes_from_the_environment(tiny_model_dir, monkeypatch):
    """PAGEDSERVE_PIECEWISE_MAX_TOKENS (an A/B of the largest piecewise bucket) sets the buckets a
    runner captures; a bad value is refused, naming the variable."""
    runner = make_runner(tiny_model_dir("llama"))
    model, kv = runner.model, runner.kv_caches
    monkeypatch.setenv("PAGEDSERVE_PIECEWISE_MAX_TOKENS", "48")
    assert PiecewiseCUDAGraphs(model, kv, MAX_TOKENS, "cpu", graph_factory=RecordedGraph).buckets == [16, 32, 48]
    monkeypatch.setenv("PAGEDSERVE_PIECEWISE_MAX_TOKENS", "2048")
    assert PiecewiseCUDAGraphs(model, kv, 4096, "cpu", graph_factory=RecordedGraph).buckets[-5:] == \
        [1024, 1280, 1536, 1792, 2048]
    for bad in ("8", "9000", "1k"):
        monkeypatch.setenv("PAGEDSERVE_PIECEWISE_MAX_TOKENS", bad)
        with pytest.raises(ValueError, match="PAGEDSERVE_PIECEWISE_MAX_TOKENS must be an integer from 16 to 8192"):
            PiecewiseCUDAGraphs(model, kv, MAX_TOKENS, "cpu", graph_factory=RecordedGraph)


def piecewise_runner(model_dir):
    runner = make_runner(model_dir)
    runner.piecewise = PiecewiseCUDAGraphs(runner.model, runner.kv_caches, MAX_TOKENS, runner.device,
                                           graph_factory=RecordedGraph)
    runner.piecewise.capture()
    return runner


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_capture_splits_at_every_attention(tiny_model_dir, arch):
    runner = piecewise_runner(tiny_model_dir(arch))
    pw = runner.piecewise
    layers = runner.hf_config.num_hidden_layers
    assert sorted(pw.pieces) == [16, 32, 48, 64]
    assert all(len(p) == layers + 1 for p in pw.pieces.values()) and pw.num_graphs == 4 * (layers + 1)
    assert [kc.data_ptr() for _, kc, _ in pw.layers] == [kc.data_ptr() for kc, _ in runner.kv_caches]
    assert all(p.ops for pieces in pw.pieces.values() for p in pieces)  # no empty piece


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_mixed_steps_equal_plain_forward(tiny_model_dir, arch):
    model_dir = tiny_model_dir(arch)
    plain, pw = make_runner(model_dir), piecewise_runner(model_dir)
    used: list[int] = []
    run = pw.piecewise.run
    pw.piecewise.run = lambda ids, pos, meta: (used.append(ids.shape[0]), run(ids, pos, meta))[1]
    prompts = {"a": list(range(3, 8)), "b": [(7 * i) % 300 + 3 for i in range(37)], "c": list(range(40, 53)),
               "d": [(11 * i) % 290 + 5 for i in range(45)], "e": list(range(100, 113)),
               "f": [(5 * i) % 280 + 9 for i in range(70)]}
    both = Lockstep(plain, pw, prompts, seed=1)
    seqs = both.seqs

    def step(*items):
        logits = both.step(*items)
        if logits[0] is None:
            assert logits[1] is None
        else:
            assert torch.equal(logits[0], logits[1])

    step(("a", None), ("b", None))                         # 42 prompt tokens: bucket 48, 6 padded rows
    step(("a", 1), ("b", 1), ("c", None))                  # 2 decodes + 13 prompt tokens: bucket 16
    step(("a", 1), ("b", 1), ("c", 1), ("d", 20))          # 23 tokens, a chunk that samples nothing
    step(("a", 1), ("b", 1), ("c", 1), ("d", None))        # 28 tokens: the chunk's rest over its KV
    step(("a", 1), ("b", 1), ("c", 1))                     # decode-only: not piecewise
    step(("a", 1), ("b", 1), ("c", 1), ("e", None))        # exactly 16 tokens, no padding
    step(("a", 1), ("b", 1), ("f", None))                  # 72 tokens: beyond the buckets, eager
    step(("a", 1), ("b", 1), ("c", 1), ("d", 1), ("e", 1), ("f", 1))
    assert used == [42, 15, 23, 28, 16]
    for name in prompts:
        assert seqs[name, 0].output_token_ids == seqs[name, 1].output_token_ids
    for (k0, v0), (k1, v1) in zip(plain.kv_caches, pw.kv_caches):
        assert torch.equal(k0, k1) and torch.equal(v0, v1)


def test_cudagraph_mode_flag():
    with pytest.raises(ValueError, match="cudagraph_mode"):
        EngineConfig(cudagraph_mode="full_decode_only")
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert engine_config_from_args(parser.parse_args([]), None).cudagraph_mode == "piecewise"
    assert engine_config_from_args(parser.parse_args(["--cudagraph-mode", "decode"]), None).cudagraph_mode == "decode"
    assert engine_config_from_args(parser.parse_args(["--cudagraph-mode", "full"]), None).cudagraph_mode == "full"


def test_engine_with_piecewise_steps_equals_eager(tiny_model_dir, monkeypatch):
    """The whole engine (overlapped steps: placeholder tokens filled on the device before the copy
    into the static buffers), with the start-up phase capturing through the recorder on CPU."""
    from pagedserve import SamplingParams
    from pagedserve.runner.model_runner import ModelRunner
    from engine.helpers import make_llm

    def capture_with_recorder(self):
        max_tokens = self.config.scheduler_config(self.max_model_len).max_num_batched_tokens
        self.piecewise = PiecewiseCUDAGraphs(self.model, self.kv_caches, max_tokens, self.device,
                                             graph_factory=RecordedGraph)
        self.piecewise.capture()

    model_dir = tiny_model_dir("llama")
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 300) for _ in range(rng.randrange(3, 60))] for _ in range(10)]
    params = [SamplingParams(temperature=0.0, max_tokens=rng.randrange(3, 12), ignore_eos=True) for _ in prompts]
    requests = [{"prompt_token_ids": p} for p in prompts]
    kw = dict(max_num_seqs=4, max_num_batched_tokens=MAX_TOKENS)
    want = [o.outputs[0].token_ids for o in make_llm(model_dir, **kw).generate(requests, params, use_tqdm=False)]
    monkeypatch.setattr(ModelRunner, "capture_piecewise_graphs", capture_with_recorder)
    llm = make_llm(model_dir, **kw)
    assert llm.llm_engine.config.async_scheduling
    runner = llm.llm_engine.runner
    used: list[int] = []
    run = runner.piecewise.run
    runner.piecewise.run = lambda ids, pos, meta: (used.append(ids.shape[0]), run(ids, pos, meta))[1]
    got = [o.outputs[0].token_ids for o in llm.generate(requests, params, use_tqdm=False)]
    assert got == want
    assert len(used) >= 5 and any(u not in runner.piecewise.buckets for u in used)
