"""Full graphs on CPU (cudagraph_mode="full"): one recorded graph per token-count bucket runs the
whole forward of a step of any mix, with a recorder standing in for torch.cuda.CUDAGraph
(tests/recorded_graph.py: a replay re-runs the recorded ops on the recorded tensors, so whatever
the step did not copy into the static buffers shows as a wrong result) and the reference
backend's static_paged_attention standing in for the unified kernel. Checked against the plain
eager runner: logits (the attention sums in another order: close, not equal), tokens and KV."""
import random
from dataclasses import replace

import pytest
import torch

from pagedserve.attention import reference
from pagedserve.runner.full_graphs import MAX_FULL_TOKENS, full_token_buckets
from attention.paged_batch import make_batch
from paged_harness import Lockstep, make_runner
from recorded_graph import RecordedGraph

MAX_TOKENS = 64


def test_full_token_buckets():
    b = full_token_buckets(100_000)
    assert b == sorted(set(b)) and b[0] == 16 and b[-1] == MAX_FULL_TOKENS
    assert full_token_buckets(MAX_TOKENS) == [16, 32, 48, 64]
    assert full_token_buckets(3000) == [b_ for b_ in b if b_ < 3000] + [3000]
    # padding above 1024 tokens stays under 25% of the step
    assert all(hi <= 1.25 * (lo + 1) for lo, hi in zip(b, b[1:]) if lo >= 1024)


def test_static_reference_attention_equals_the_loop():
    """The shape-static reference (a graph's CPU attention) against the per-sequence loop, with a
    bucket's padding: sequences of no tokens at the end and rows outside every sequence (zeros)."""
    batch = make_batch([(20, 1), (0, 1), (37, 1), (0, 19), (13, 6), (7, 30)], 3, H=8, Hkv=2, D=16, block_size=8)
    kc, vc = batch.k_cache, batch.v_cache
    reference.write_kv(batch.new_k, batch.new_v, kc, vc, batch.meta.slot_mapping)
    want = reference.paged_attention(batch.query, kc, vc, batch.meta, scale=0.25)
    m = batch.meta
    n = batch.query.shape[0]
    padded = replace(m, query_start_loc=torch.cat([m.query_start_loc, m.query_start_loc[-1:].repeat(3)]),
                     seq_lens=torch.cat([m.seq_lens, torch.ones(3, dtype=torch.int32)]),
                     block_tables=torch.cat([m.block_tables, torch.zeros(3, m.block_tables.shape[1], dtype=torch.int32)]),
                     seq_lens_cpu=None, query_lens_cpu=None, unified_capacity=(80, 80))
    query = torch.cat([batch.query, torch.randn(7, 8, 16)])
    got = reference.paged_attention(query, kc, vc, padded, scale=0.25)
    torch.testing.assert_close(got[:n], want, rtol=1e-5, atol=1e-5)
    assert torch.equal(got[n:], torch.zeros(7, 8, 16))


def test_write_kv_skips_minus_one_slots_with_static_shapes():
    batch = make_batch([(5, 1), (0, 7), (9, 4)], 1, H=4, Hkv=2, D=8, block_size=8)
    slots = batch.meta.slot_mapping.clone()
    slots[0] = slots[5] = -1
    before_k = batch.k_cache.clone()
    reference.write_kv(batch.new_k, batch.new_v, batch.k_cache, batch.v_cache, slots)
    bs = 8
    for i, s in enumerate(slots.tolist()):
        if s >= 0:
            assert torch.equal(batch.k_cache[s // bs, s % bs], batch.new_k[i])
    untouched = torch.ones(batch.k_cache.shape[:2], dtype=torch.bool)
    for s in slots.tolist():
        if s >= 0:
            untouched[s // bs, s % bs] = False
    assert torch.equal(batch.k_cache[untouched], before_k[untouched])
    none = torch.full_like(slots, -1)  # a step that writes nothing (a graph captured empty)
    k_now = batch.k_cache.clone()
    reference.write_kv(batch.new_k, batch.new_v, batch.k_cache, batch.v_cache, none)
    assert torch.equal(batch.k_cache, k_now)


def full_runner(model_dir):
    runner = make_runner(model_dir)
    runner.config.cudagraph_mode = "full"
    runner.config.max_num_batched_tokens = MAX_TOKENS
    runner.config.max_num_seqs = 8
    runner.capture_full_graphs(graph_factory=RecordedGraph)
    return runner


def test_mixed_steps_replay_one_graph_each(tiny_model_dir):
    model_dir = tiny_model_dir("llama")
    plain, full = make_runner(model_dir), full_runner(model_dir)
    fg = full.full_graphs
    assert sorted(fg.graphs) == [16, 32, 48, 64]
    rng = random.Random(0)
    prompts = {k: [rng.randrange(3, 300) for _ in range(n)] for k, n in
               {"a": 5, "b": 37, "c": 13, "d": 130, "e": 16, "f": 70}.items()}
    both = Lockstep(plain, full, prompts, seed=1)
    seqs = both.seqs

    def step(*items):
        logits = both.step(*items)
        if logits[0] is None:
            assert logits[1] is None
        else:
            torch.testing.assert_close(logits[0], logits[1], rtol=1e-4, atol=1e-4)

    step(("a", None), ("b", None))                         # 42 prompt tokens: bucket 48
    step(("a", 1), ("b", 1), ("c", None))                  # 2 decodes + 13 prompt tokens: bucket 16
    step(("a", 1), ("b", 1), ("c", 1), ("d", 40))          # a chunk that samples nothing: 43 tokens
    step(("a", 1), ("b", 1), ("c", 1), ("d", 60))          # the chunk goes on over its KV, crossing blocks
    step(("a", 1), ("b", 1), ("c", 1))                     # decode-only, no decode graphs on CPU: full too
    step(("a", 1), ("b", 1), ("c", 1), ("d", None), ("e", None))  # 30 + 16 + 3 tokens
    step(("a", 1), ("b", 1), ("f", None))                  # 72 tokens: beyond the buckets, eager
    assert [p for _, p in both.paths] == ["full_graph"] * 6 + ["eager"]
    assert all(g.num_replays for t, g in fg.graphs.items() if t in (16, 48, 64))
    for name in prompts:
        if (name, 0) in seqs:
            assert seqs[name, 0].output_token_ids == seqs[name, 1].output_token_ids
    for (k0, v0), (k1, v1) in zip(plain.kv_caches, full.kv_caches):
        torch.testing.assert_close(k0, k1, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(v0, v1, rtol=1e-4, atol=1e-4)


def test_steps_with_a_gathered_chunk_run_eagerly_in_full_mode(tiny_model_dir, monkeypatch):
    """Where the gathered long-prefill path is on (a stand-in here, with the buckets shrunk), a step
    carrying a chunk it takes runs eagerly, as in piecewise mode, not as a full graph (whose
    unified kernel would attend the chunk); the steps around it still replay full graphs, and the
    outputs equal the eager runner's."""
    from pagedserve.attention import gathered_prefill as gp, gathered_prefill_plan as plan
    for name, value in (("PREFIX_BUCKET", 16), ("QUERY_BUCKET", 8), ("MIN_PREFIX", 32), ("MIN_CHUNK", 16)):
        monkeypatch.setattr(plan, name, value)
    model_dir = tiny_model_dir("llama")
    plain, full = make_runner(model_dir), full_runner(model_dir)
    device = full.kv_caches[0][0].device
    # (on CPU the eager forward attends by reference.py: only the routing is under test here)
    monkeypatch.setitem(gp._ACTIVE, device, gp.GatheredPrefill(512, 1, 8, torch.float32, device))
    rng = random.Random(3)
    prompts = {"a": [rng.randrange(3, 300) for _ in range(6)], "d": [rng.randrange(3, 300) for _ in range(90)]}
    both = Lockstep(plain, full, prompts, seed=2)

    def step(*items):
        logits = both.step(*items)
        if logits[0] is not None:
            torch.testing.assert_close(logits[0], logits[1], rtol=1e-4, atol=1e-4)

    step(("a", None), ("d", 40))      # d's first 40 tokens: no prefix, not the path
    step(("a", 1), ("d", 30))         # 30 after 40: the path's (>= 16 after >= 32), 31 tokens
    step(("a", 1), ("d", None))       # d's last 20: the path's too
    step(("a", 1), ("d", 1))          # decodes
    assert [p for _, p in both.paths] == ["full_graph", "eager", "eager", "full_graph"]
    assert both.seqs["d", 0].output_token_ids == both.seqs["d", 1].output_token_ids


@pytest.mark.parametrize("arch", ["llama", "gemma2"])
def test_engine_with_long_prompts_takes_the_full_graph(tiny_model_dir, monkeypatch, arch):
    """The whole engine (overlapped steps, chunked prefill): prompts of up to 300 tokens through a
    64-token budget, so most steps carry a chunk beside decodes; every step with prefill tokens
    replays a full graph, and the outputs equal the eager engine's. gemma2: layers with a 16-token
    sliding window and soft-capped scores beside full ones, in the graphs' static attention too."""
    from pagedserve import SamplingParams
    from pagedserve.runner.model_runner import ModelRunner
    from engine.helpers import make_llm

    model_dir = tiny_model_dir(arch)
    rng = random.Random(1)
    prompts = [[rng.randrange(3, 300) for _ in range(n)] for n in (300, 9, 200, 5)]
    params = [SamplingParams(temperature=0.0, max_tokens=rng.randrange(4, 8), ignore_eos=True) for _ in prompts]
    requests = [{"prompt_token_ids": p} for p in prompts]
    kw = dict(max_num_seqs=4, max_num_batched_tokens=MAX_TOKENS, max_model_len=512)
    want = [o.outputs[0].token_ids for o in make_llm(model_dir, **kw).generate(requests, params, use_tqdm=False)]

    original = ModelRunner.capture_full_graphs
    monkeypatch.setattr(ModelRunner, "capture_full_graphs", lambda self: original(self, graph_factory=RecordedGraph))
    llm = make_llm(model_dir, cudagraph_mode="full", **kw)
    runner = llm.llm_engine.runner.runner  # the ModelRunner inside the one-rank executor
    assert runner.full_graphs is not None and runner.piecewise is None
    steps = []
    execute = runner.execute_model

    def traced(step, prev=None):
        out = execute(step, prev)
        if step.batch is not None:
            steps.append((step.batch.num_decodes, len(step.batch.query_lens), runner.last_graph_path))
        return out
    runner.execute_model = traced
    got = [o.outputs[0].token_ids for o in llm.generate(requests, params, use_tqdm=False)]
    assert got == want
    mixed = [p for nd, n, p in steps if 0 < nd < n]
    assert len(mixed) >= 3 and set(mixed) == {"full_graph"}
    assert {p for nd, n, p in steps if nd < n} == {"full_graph"}
