"""Short prefills as decode rows (runner/decode_rows.py): the rewritten metadata attends exactly as
the step's own (plain-torch reference attention), the limits hold, and a runner whose decode
graphs are replaced by an eager stand-in runs mixed steps through it with the logits of the plain
runner."""
import random

import numpy as np
import pytest
import torch

from pagedserve.attention import reference
from pagedserve.runner.batch import build_model_input
from pagedserve.runner.decode_rows import SHORT_PREFILL_ENV, as_decode_rows, short_prefill_graphs_enabled
from paged_harness import Lockstep, make_runner

BLOCK = 4


def mixed_batch(contexts: list[int], query_lens: list[int], num_decodes: int, seed: int = 0):
    """(ModelInput, q, k_cache, v_cache): scattered blocks, random K/V in every slot."""
    rng = random.Random(seed)
    free = list(range(64))
    rng.shuffle(free)
    tables = [[free.pop() for _ in range(-(-(c + q) // BLOCK))] for c, q in zip(contexts, query_lens)]
    num_tokens = sum(query_lens)
    inp = build_model_input(np.arange(num_tokens) + 3, np.array(contexts), np.array(query_lens), tables,
                            np.ones(len(contexts), dtype=bool), num_decodes, BLOCK, torch.device("cpu"))
    g = torch.Generator().manual_seed(seed)
    k_cache = torch.randn(64, BLOCK, 2, 8, generator=g)
    v_cache = torch.randn(64, BLOCK, 2, 8, generator=g)
    q = torch.randn(num_tokens, 4, 8, generator=g)
    return inp, q, k_cache, v_cache


@pytest.mark.parametrize("contexts,query_lens,num_decodes", [
    ([9, 3], [1, 1], 1),                      # a decode beside a one-token prefill
    ([5, 17, 0, 0], [1, 1, 6, 11], 2),        # two decodes, two fresh prompts
    ([7, 30], [1, 9], 1),                     # a chunk over 30 positions already cached
    ([0, 12], [5, 3], 0),                     # no decodes at all
])
def test_rows_attend_as_the_step(contexts, query_lens, num_decodes):
    inp, q, kc, vc = mixed_batch(contexts, query_lens, num_decodes)
    rows = as_decode_rows(inp.attn_meta, inp.positions)
    assert rows is not None and rows.num_decodes == rows.num_seqs == len(q) and rows.max_query_len == 1
    assert rows.seq_lens.tolist() == rows.seq_lens_cpu == (inp.positions + 1).tolist()
    assert rows.max_seq_len == max(c + n for c, n in zip(contexts, query_lens))
    assert torch.equal(rows.slot_mapping, inp.attn_meta.slot_mapping)
    want = reference.paged_attention(q, kc, vc, inp.attn_meta, 0.3)
    got = reference.paged_attention(q, kc, vc, rows, 0.3)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_limits():
    inp, *_ = mixed_batch([4, 0], [1, 20], 1)
    meta, pos = inp.attn_meta, inp.positions
    assert as_decode_rows(meta, pos, max_prefill_tokens=20) is not None
    assert as_decode_rows(meta, pos, max_prefill_tokens=19) is None
    assert as_decode_rows(meta, pos, max_prefill_positions=sum(range(1, 21))) is not None
    assert as_decode_rows(meta, pos, max_prefill_positions=sum(range(1, 21)) - 1) is None
    decodes, *_ = mixed_batch([4, 6], [1, 1], 2)
    assert as_decode_rows(decodes.attn_meta, decodes.positions) is None  # nothing to rewrite
    meta.seq_lens_cpu = None
    assert as_decode_rows(meta, pos) is None  # no host lengths: it would have to sync


def test_switch(monkeypatch):
    assert short_prefill_graphs_enabled()
    monkeypatch.setenv(SHORT_PREFILL_ENV, "0")
    assert not short_prefill_graphs_enabled()
    monkeypatch.setenv(SHORT_PREFILL_ENV, "yes")
    with pytest.raises(ValueError, match=SHORT_PREFILL_ENV):
        short_prefill_graphs_enabled()


class EagerDecodeGraphs:
    """Stands in for DecodeCUDAGraphs: buckets up to `largest` tokens, run = the eager forward with
    the metadata it is given (what a replay computes), each call's metadata kept."""

    def __init__(self, runner, largest: int):
        self.runner, self.largest, self.metas = runner, largest, []

    def bucket_for(self, n: int) -> int | None:
        return n if n <= self.largest else None

    def run(self, input_ids, positions, meta):
        self.metas.append(meta)
        return self.runner.model(input_ids, positions, self.runner.kv_caches, meta)


def test_runner_sends_short_prefills_to_the_decode_graphs(tiny_model_dir):
    model_dir = tiny_model_dir("llama")
    plain, rows = make_runner(model_dir), make_runner(model_dir)
    graphs = rows.graphs = EagerDecodeGraphs(rows, largest=40)
    assert rows.short_prefill_graphs
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 300) for _ in range(n)] for n in (6, 11, 30, 50, 9)]
    both = Lockstep(plain, rows, prompts, seed=3)
    paths = both.paths

    def step(*items):
        out = both.step(*items)
        torch.testing.assert_close(out[1], out[0], rtol=1e-4, atol=1e-4)
        assert torch.equal(out[1].argmax(-1), out[0].argmax(-1))

    step((0, None), (1, None))                    # 17 prompt tokens: rows
    step((0, 1), (1, 1), (2, None))               # 2 decodes + 30 prompt tokens: rows
    step((0, 1), (1, 1), (2, 1), (3, None))       # 53 tokens: over the largest bucket, eager
    step((0, 1), (1, 1), (2, 1), (3, 1), (4, 5))  # 4 decodes + 5 of 9 prompt tokens: samples nothing
    step((0, 1), (1, 1), (2, 1), (3, 1), (4, None))  # the 4 left, over the 5 cached
    step((0, 1), (1, 1), (2, 1), (3, 1), (4, 1))  # decode-only: the decode graph as always
    assert [m.num_seqs for m in graphs.metas] == [17, 32, 9, 8, 5]
    # what each runner says it did (the step trace's `graph`): the plain one has no graphs
    assert paths == [("eager", "decode_rows"), ("eager", "decode_rows"), ("eager", "eager"),
                     ("eager", "decode_rows"), ("eager", "decode_rows"), ("eager", "decode_graph")]
    assert all(m.num_decodes == m.num_seqs and m.max_query_len == 1 for m in graphs.metas)
