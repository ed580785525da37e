"""A decode step as two nano-batches (models/nano_batches.py) computes what the one forward does.

On a CPU the side stream is absent, so these check the order and the split metadata: each half's
attention sees its own rows' lengths and pages, the residual streams stay apart, the layers run
in the pipeline's order. The GPU's streams and graphs: tests/runner/test_nano_batches_gpu.py.
"""
import random

import pytest
import torch

from pagedserve.attention.metadata import AttentionMetadata
from pagedserve.config import EngineConfig
from pagedserve.core.plan import SchedulerOutput
from pagedserve.models.nano_batches import forward_nano_batches, split_decode_meta
from pagedserve.runner.decode_rows import as_decode_rows
from paged_harness import HandDriver, Lockstep, make_runner
from tiny_models import MOE_ARCHS

FAMILY = ("llama", "qwen3", "qwen2", "mistral") + MOE_ARCHS


@pytest.mark.parametrize("arch", FAMILY)
def test_runner_nano_batched_decodes_match_the_plain_forward(tiny_model_dir, arch):
    model_dir = tiny_model_dir(arch)
    plain, nano = make_runner(model_dir, block_size=4), make_runner(model_dir, block_size=4, nano_batch_rows=3)
    rng = random.Random(1)
    prompts = [[rng.randrange(3, 300) for _ in range(n)] for n in (5, 17, 2, 33, 9)]
    both = Lockstep(plain, nano, prompts, seed=4)

    def step(*items):
        out = both.step(*items)
        torch.testing.assert_close(out[1], out[0], rtol=1e-5, atol=1e-5)

    step((0, None), (1, None), (2, None))      # prefill: one forward
    step((0, 1), (1, 1))                       # 2 decodes: below nano_batch_rows
    step((0, 1), (1, 1), (2, 1))               # 3 decodes: halves of 1 and 2 rows
    step((3, None), (4, None))
    for _ in range(4):                         # 5 decodes of unlike lengths, across block boundaries
        step((0, 1), (1, 1), (2, 1), (3, 1), (4, 1))
    assert both.paths == [("eager", "eager"), ("eager", "eager"), ("eager", "nano_batches"),
                          ("eager", "eager")] + [("eager", "nano_batches")] * 4


def test_split_decode_meta():
    n, lens = 5, [3, 7, 1, 9, 4]
    meta = AttentionMetadata(
        slot_mapping=torch.arange(10, 10 + n), query_start_loc=torch.arange(n + 1, dtype=torch.int32),
        seq_lens=torch.tensor(lens, dtype=torch.int32), block_tables=torch.arange(15, dtype=torch.int32).view(n, 3),
        num_decodes=n, max_query_len=1, max_seq_len=64, block_size=4, query_lens_cpu=[1] * n,
        seq_lens_cpu=lens, decode_split_tokens=-1)
    a, b = split_decode_meta(meta, 2)
    for half, rows in ((a, slice(0, 2)), (b, slice(2, 5))):
        count = rows.stop - rows.start
        assert torch.equal(half.slot_mapping, meta.slot_mapping[rows])
        assert torch.equal(half.seq_lens, meta.seq_lens[rows])
        assert torch.equal(half.block_tables, meta.block_tables[rows])
        assert half.query_start_loc.tolist() == list(range(count + 1))
        assert half.seq_lens_cpu == lens[rows] and half.query_lens_cpu == [1] * count
        assert (half.num_decodes, half.max_query_len, half.max_seq_len, half.block_size) == (count, 1, 64, 4)
        assert half.decode_split_tokens == -1 and half.decode_order is None
    with pytest.raises(ValueError, match="decode-only"):
        split_decode_meta(meta, 0)
    meta.num_decodes = 4  # the last row a prefill chunk
    with pytest.raises(ValueError, match="decode-only"):
        split_decode_meta(meta, 2)


def test_decode_rows_of_one_sequence_across_both_halves(tiny_model_dir):
    """A short prefill replayed as decode rows (runner/decode_rows.py) may put one sequence's rows
    in both halves: the second half's rows read K/V that the first half's attention wrote in the
    same layer. Each runner computes the chunk once, over a cache where it is not yet written."""
    model_dir = tiny_model_dir("llama")
    hidden = []
    for nano in (False, True):
        runner = make_runner(model_dir, block_size=4)
        driver = HandDriver(runner, seed=2)
        a, b = driver.add(list(range(10, 21))), driver.add(list(range(40, 47)))
        driver.step([driver.schedule(a, 6), driver.schedule(b)])
        step = runner.prepare_inputs(SchedulerOutput(scheduled=[driver.schedule(a)]))  # a's last 5 tokens
        inp = step.batch.to_model_input(runner.block_size, runner.device)
        rows = as_decode_rows(inp.attn_meta, inp.positions)
        assert rows is not None and rows.seq_lens_cpu == [7, 8, 9, 10, 11]
        with torch.inference_mode():
            if nano:
                hidden.append(forward_nano_batches(runner.model, inp.input_ids, inp.positions, runner.kv_caches,
                                                   split_decode_meta(rows, 2)))
            else:
                hidden.append(runner.model(inp.input_ids, inp.positions, runner.kv_caches, rows))
    torch.testing.assert_close(hidden[1], hidden[0], rtol=1e-5, atol=1e-5)


def test_config_checks(tiny_model_dir):
    with pytest.raises(ValueError, match="nano_batch_rows must be 0"):
        EngineConfig(model="m", nano_batch_rows=1)
    with pytest.raises(ValueError, match="needs nano_batch_rows"):
        EngineConfig(model="m", nano_batch_sm_carveout=16)
    with pytest.raises(ValueError, match="Llama-family"):
        make_runner(tiny_model_dir("opt"), nano_batch_rows=2)


def test_halves_start_16_byte_aligned():
    """The second half's slot_mapping (int64) starts at a multiple of 16 bytes for every n >= 4, so
    eager steps meet the pointer alignment the warm-up's even buckets compile (Triton specializes on
    it); below 4 rows the split is one row."""
    from pagedserve.models.nano_batches import half_rows
    for n in range(4, 600):
        h = half_rows(n)
        assert (h * 8) % 16 == 0 and 0 < h < n and abs(n - 2 * h) <= 3, n
    assert half_rows(2) == half_rows(3) == 1
