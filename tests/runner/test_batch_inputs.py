"""build_model_input's decode-only path builds what the general (per-token) path builds."""
import random

import numpy as np
import pytest
import torch

from pagedserve.runner.batch import build_model_input


@pytest.mark.parametrize("seed", range(4))
def test_decode_only_inputs_match_general_path(seed):
    rng = random.Random(seed)
    bs, n = 4, rng.randint(1, 12)
    starts = [rng.randint(0, 40) for _ in range(n)]
    # Tables at least as long as needed, some longer (contiguous reservations), equal widths when seed is 0.
    lens = [s // bs + 1 + (rng.randint(0, 2) if seed else 0) for s in starts]
    if seed == 0:
        lens = [max(lens)] * n
    pool = rng.sample(range(1000), sum(lens))
    tables, off = [], 0
    for k in lens:
        tables.append(pool[off:off + k])
        off += k
    ids = np.array([rng.randrange(100) for _ in range(n)], dtype=np.int64)
    mask = np.array([rng.random() < 0.8 for _ in range(n)]) if seed % 2 else np.ones(n, dtype=bool)
    args = (ids, np.array(starts), np.ones(n, dtype=np.int64), tables, mask)
    fast = build_model_input(*args, n, bs, torch.device("cpu"), pad_blocks_to=3 if seed == 3 else None)
    ref = build_model_input(*args, 0, bs, torch.device("cpu"), pad_blocks_to=3 if seed == 3 else None)
    for name in ("input_ids", "positions", "sample_indices"):
        assert torch.equal(getattr(fast, name), getattr(ref, name)), name
    for name in ("slot_mapping", "query_start_loc", "seq_lens", "block_tables"):
        assert torch.equal(getattr(fast.attn_meta, name), getattr(ref.attn_meta, name)), name
    for name in ("max_query_len", "max_seq_len", "query_lens_cpu", "seq_lens_cpu"):
        assert getattr(fast.attn_meta, name) == getattr(ref.attn_meta, name), name
    assert fast.num_sampling == ref.num_sampling and fast.attn_meta.num_decodes == n
    # Slots are where each decode writes: its position's block and offset.
    expect = [tables[i][s // bs] * bs + s % bs for i, s in enumerate(starts)]
    assert fast.attn_meta.slot_mapping.tolist() == expect
