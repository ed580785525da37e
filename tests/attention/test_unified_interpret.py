"""The unified varlen kernel matches reference.py under the Triton interpreter on CPU: its cases
(unified_interpret_cases.py) run in a subprocess with TRITON_INTERPRET=1, as test_triton_interpret.py
runs the other kernels' (beside them: tests/interpreter_runs.py). The work list itself is plain torch and is checked here directly."""
import random
from pathlib import Path

import pytest
import torch

from pagedserve.attention import triton_unified as unified
from interpreter_runs import assert_cases_passed

CASES = Path(__file__).with_name("unified_interpret_cases.py")


@pytest.mark.interpreter_cases(CASES, timeout=300)
def test_unified_kernel_matches_reference_under_interpreter(interpreter_run):
    proc = interpreter_run(CASES)
    assert_cases_passed(proc)


@pytest.mark.parametrize("window", [0, 1, 100])
@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("share,kv_heads", [(4, 1), (528, 8), (32, 2)])
def test_work_list_covers_every_tile_within_capacity(seed, share, kv_heads, window):
    """Random mixes of decodes and chunks (and padding sequences of no tokens) in a bucket of T
    tokens: the work list fits the capacity computed from T and the sequence count alone, and
    each q tile's splits cover [its first token's earliest visible position rounded down to a KV
    tile (0 without a sliding window), its last token's context) once, in order, none empty."""
    rng = random.Random(seed)
    block_q, block_n = rng.choice([(1, 16), (8, 64), (32, 16)])
    T = rng.choice([16, 64, 512])
    max_seqs = rng.choice([4, 16, 64])
    q_lens, left = [], T - rng.randrange(T // 2)
    while left > 0 and len(q_lens) < max_seqs:
        q = 1 if rng.random() < 0.5 else rng.randrange(1, left + 1)
        q = min(q, left)
        q_lens.append(q)
        left -= q
    seq_lens = [q + rng.choice([0, 1, 17, 300, 5000]) for q in q_lens]
    pad = max_seqs - len(q_lens)
    qsl = torch.tensor([0] + list(torch.tensor(q_lens).cumsum(0)) + [sum(q_lens)] * pad, dtype=torch.int32)
    lens = torch.tensor(seq_lens + [1] * pad, dtype=torch.int32)
    max_qtiles, capacity = unified.work_capacity(T, max_seqs, kv_heads, block_q, share)
    work = unified.build_work(qsl, lens, kv_heads, block_q, block_n, max_qtiles, capacity, share, 1, window=window)
    items = [tuple(r) for r in work.items.tolist() if r[0] >= 0]
    expect_tiles = [(s, t) for s, q in enumerate(q_lens) for t in range(-(-q // block_q))]
    assert [(r[0], r[1]) for r in work.qtiles.tolist() if r[0] >= 0] == expect_tiles
    n_items = int(work.qtiles[:, 3].sum())
    assert len(items) == n_items <= capacity, "items dropped: the capacity bound is wrong"
    for seq, tile in expect_tiles:
        mine = [(a, b, n) for s, t, a, b, n in items if (s, t) == (seq, tile)]
        kv_len = seq_lens[seq] - q_lens[seq] + min((tile + 1) * block_q, q_lens[seq])
        first_seen = max(0, seq_lens[seq] - q_lens[seq] + tile * block_q - window + 1) if window else 0
        assert mine[0][0] == first_seen // block_n * block_n and mine[-1][1] == kv_len and len(mine) == mine[0][2] <= unified.MAX_SPLITS
        assert all(a < b and a % block_n == 0 for a, b, _ in mine)
        assert all(mine[i][1] == mine[i + 1][0] for i in range(len(mine) - 1))


def test_unified_launch_switch():
    assert unified.parse_unified_launch("") == unified.UNIFIED_DEFAULT
    got = unified.parse_unified_launch("bm128+bn32+w8+s3")
    assert (got.block_m, got.block_n, got.num_warps, got.num_stages) == (128, 32, 8, 3)
    for bad in ("bm48", "bn8", "x4", "w0", "bm", "gqa", "lpt"):  # the prefill kernel's flags, not this one's
        with pytest.raises(ValueError, match=unified.UNIFIED_LAUNCH_ENV):
            unified.parse_unified_launch(bad)
