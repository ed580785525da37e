"""The decode grid's split count and the PAGEDSERVE_DECODE_SPLIT_TOKENS switch (host side of
triton_decode's plans; the kernels themselves are checked in triton_interpret_cases.py)."""
import pytest
import torch

from pagedserve.attention import decode_plan as plan


def grid(base, max_len, tokens, n=64, kv=8, sms=132):
    return plan.grid_splits(base, max_len, tokens, n, kv, sms)


def test_grid_fits_the_longest_sequence_at_split_tokens():
    assert grid(1, 4096, 512) == 8        # a 64-sequence decode graph: base 1
    assert grid(12, 4096, 512) == 12      # a small batch already asks for more
    assert grid(1, 300, 512) == 1         # eager, short contexts: nothing to cut
    assert grid(3, 4096, 0) == 3          # off: the base alone
    assert grid(1, 10 ** 6, 512) == plan.MAX_SPLITS


def test_balanced_grid_keeps_to_the_program_budget():
    budget = plan.DECODE_GRID_PROGRAMS_PER_SM * 132          # 1056 programs
    assert grid(1, 4096, plan.BALANCED, n=64) == 3           # ceil(1056 / 512)
    assert grid(1, 4096, plan.BALANCED, n=96) == 2
    assert grid(1, 4096, plan.BALANCED, n=256) == 2          # at least 2
    assert grid(3, 4096, plan.BALANCED, n=256) == 3          # never below the base
    assert grid(1, 4096, plan.BALANCED, n=1, kv=1) == 4096 // plan.MIN_TOKENS_PER_SPLIT
    assert grid(1, 700, plan.BALANCED, n=8) == 3             # splits of at least 256 positions
    for n in range(1, 300):
        g = grid(1, 4096, plan.BALANCED, n=n)
        assert g == 2 or n * 8 * (g - 1) < budget


def test_one_sequence_gets_at_most_one_wave_of_programs():
    """One 100k sequence of 8 KV heads on 132 SMs: base and grid 49 splits (392 programs, within the
    396 resident at once), where the rounding up of 396 / 8 and the program budget gave 50 and 64;
    the kernels' balanced cut then stops at 49 too. Two sequences: 25 base splits, as before."""
    cpu = torch.device("cpu")
    assert plan.wave_splits(8, 132) == 49 and plan.wave_splits(40, 132) == 9
    base, grid_, mode = plan.decode_launch(1, 8, 131072, cpu, split_tokens=plan.BALANCED)
    assert (base, grid_, mode) == (49, 49, 0)
    assert _kernel_parts([100_000], 1, 8, 131072, 128)[1] == [49]
    assert plan.choose_num_splits(2, 8, 131072, cpu) == 25          # the cap binds on one sequence only
    assert grid(25, 131072, plan.BALANCED, n=2) == 49               # 66 by the budget alone
    assert grid(1, 10 ** 6, 4096, n=1) == plan.MAX_SPLITS           # splits by size: the caller's choice
    assert plan.choose_num_splits(1, 40, 131072, cpu) == 9          # MHA: 360 programs, not 400


def test_launch_passes_the_mode_only_when_the_grid_has_room():
    cpu = torch.device("cpu")
    assert plan.decode_launch(64, 8, 4096, cpu, split_tokens=plan.BALANCED) == (1, 3, plan.BALANCED)
    assert plan.decode_launch(256, 8, 4096, cpu, split_tokens=plan.BALANCED) == (1, 2, plan.BALANCED)
    assert plan.decode_launch(64, 8, 200, cpu, split_tokens=plan.BALANCED) == (1, 1, 0)
    assert plan.decode_launch(64, 8, 4096, cpu, split_tokens=0) == (1, 1, 0)
    assert plan.decode_launch(64, 8, 4096, cpu, num_splits=2, split_tokens=1024) == (2, 4, 1024)


def test_slots_give_one_sequence_up_to_a_wave_of_splits():
    """The slots' grid's most splits of one sequence do not depend on the rows beside it: one wave
    of programs, splits of at least MIN_TOKENS_PER_SPLIT, never below the base."""
    assert plan.slot_parts(1, 4096, 8, 132) == 4096 // plan.MIN_TOKENS_PER_SPLIT    # 16
    assert plan.slot_parts(1, 131072, 8, 132) == plan.wave_splits(8, 132) == 49
    assert plan.slot_parts(1, 131072, 1, 132) == plan.MAX_SPLITS
    assert plan.slot_parts(1, 700, 8, 132) == 3
    assert plan.slot_parts(20, 4096, 8, 132) == 20


def test_a_long_sequence_beside_short_ones_takes_the_slots_grid():
    """The mix the 41st session measured (docs/long-context-history.md): one 32k-token sequence decoding
    beside 15 short ones, a 16-row decode graph, 8 KV heads. The even share asks for chains of 4
    tiles; the rows' grid (9 splits a row at 16 rows) leaves the long one chains of 29, the slots'
    grid cuts it in 49 parts of whole tiles, 6 each (43 non-empty): a decode graph replays the
    slots' (SLOTS), and every split has its slot."""
    cpu = torch.device("cpu")
    lens = [32768] + [300] * 15
    base, splits, mode = plan.decode_launch(16, 8, 40960, cpu, split_tokens=plan.BALANCED)
    most = plan.slot_parts(base, 40960, 8, 132)
    assert (base, splits, most, mode) == (4, 9, 49, plan.BALANCED)
    work = (256 + 15 * 3) * 8
    chain = -(-work // (plan.DECODE_SHARE_PROGRAMS_PER_SM * 132))
    assert chain == 4 and -(-256 // splits) == 29
    assert plan.takes_slots(256, chain, base, splits, most, 16)
    parts = _kernel_parts(lens, 16, 8, 40960, 128, slots=True)[1]
    assert parts[0] == 43 and -(-256 // 43) == 6
    share = plan.DECODE_SHARE_PROGRAMS_PER_SM * 132
    assert sum(parts) <= plan.balanced_slots(16, 8, base, most, share)
    assert plan.pick_split_mode(lens, 16, 8, 40960, cpu) == plan.SLOTS
    assert plan.decode_launch(16, 8, 40960, cpu, split_tokens=plan.SLOTS) == (base, most, plan.SLOTS)
    assert plan.graph_split_modes(16, 8, 40960, cpu) == [0, plan.BALANCED, plan.SLOTS]


def test_a_mildly_uneven_step_keeps_the_rows_grid():
    """Serving's contexts at 64 rows (one of 1,871 tokens among ~500): the slots' grid would save
    the longest chain a few tiles, less than its scans cost at 64 rows: the rows' grid."""
    cpu = torch.device("cpu")
    base, splits, _ = plan.decode_launch(64, 8, 4096, cpu, split_tokens=plan.BALANCED)
    most = plan.slot_parts(base, 4096, 8, 132)
    assert (base, splits, most) == (1, 3, 16)
    longest, chain = -(-1871 // 128), 2
    gain = -(-longest // 3) - -(-longest // min(-(-longest // chain), most))
    assert gain == 3 and not plan.takes_slots(longest, chain, base, splits, most, 64)
    assert plan.pick_split_mode([1871] + [500] * 63, 64, 8, 4096, cpu) == plan.BALANCED


@pytest.mark.parametrize("seed", range(40))
def test_balanced_slots_hold_every_split(seed):
    """balanced_slots bounds the slots the kernels' plan takes (every row's parts, padding rows
    included), for any lengths, padded rows, shares and tile sizes; and a graph replays SLOTS only
    where it was captured with it (graph_split_modes)."""
    import random
    rng = random.Random(seed)
    rows = rng.choice([1, 2, 4, 8, 16, 33, 64, 256, 300])
    kv, block_n = rng.choice([1, 2, 8, 40]), rng.choice([16, 64, 128, 256])
    share = rng.choice([1, 4, 50, 792, 5000])
    lens = [rng.choice([1, 2, 200, 4000, rng.randrange(1, 131072)]) for _ in range(rng.randrange(1, rows + 1))]
    cpu = torch.device("cpu")
    base, most, _ = plan.decode_launch(rows, kv, 131072, cpu, split_tokens=plan.SLOTS)
    assert most == plan.slot_parts(base, 131072, kv, 132)
    padded = list(lens) + [1] * (rows - len(lens))
    work = sum(-(-n // block_n) for n in padded) * kv
    chain = max(-(-work // share), max(1, plan.MIN_TOKENS_PER_SPLIT // block_n))
    slots = sum(min(max(-(-(-(-n // block_n)) // chain), base), most) for n in padded)   # parts, as slot_plan counts
    assert slots <= plan.balanced_slots(rows, kv, base, most, share)
    picked = plan.pick_split_mode(lens, rows, kv, 131072, cpu, block_n=block_n)
    assert picked in plan.graph_split_modes(rows, kv, 131072, cpu, block_n=block_n)


@pytest.mark.parametrize("raw, want", [("", plan.DECODE_SPLIT_TOKENS), ("0", 0), ("1024", 1024),
                                       ("balanced", plan.BALANCED)])
def test_switch(monkeypatch, raw, want):
    monkeypatch.setenv(plan.SPLIT_TOKENS_ENV, raw)
    plan.decode_split_tokens.cache_clear()
    try:
        assert plan.decode_split_tokens() == want
    finally:
        plan.decode_split_tokens.cache_clear()


@pytest.mark.parametrize("raw", ["-1", "lots", "Balanced"])
def test_bad_switch_names_it(monkeypatch, raw):
    monkeypatch.setenv(plan.SPLIT_TOKENS_ENV, raw)
    plan.decode_split_tokens.cache_clear()
    try:
        with pytest.raises(ValueError, match=plan.SPLIT_TOKENS_ENV):
            plan.decode_split_tokens()
    finally:
        plan.decode_split_tokens.cache_clear()


def _kernel_parts(lens, rows, kv, max_len, block_n, sms=132, slots=False):
    """The kernels' balanced plan (triton_decode's balanced_chain_tiles and _balanced_parts) written out in
    Python: each sequence's number of non-empty splits in the rows' grid, or with slots=True in the
    slots' (at most slot_parts a sequence)."""
    base, most, mode = plan.decode_launch(rows, kv, max_len, torch.device("cpu"), split_tokens=plan.BALANCED)
    if slots:
        most = plan.slot_parts(base, max_len, kv, sms)
    padded = list(lens) + [1] * (rows - len(lens))
    work = sum(-(-n // block_n) for n in padded) * kv
    chain = max(-(-work // (plan.DECODE_SHARE_PROGRAMS_PER_SM * sms)), plan.MIN_TOKENS_PER_SPLIT // block_n)
    out = []
    for n in lens:
        parts = min(max(-(-(-(-n // block_n)) // chain), base), most)
        split_len = max(-(-(-(-n // parts)) // block_n) * block_n, block_n)
        out.append(-(-n // split_len))
    return base, out


@pytest.mark.parametrize("lens, rows, want", [
    ([1871] + [300] * 63, 64, plan.BALANCED),     # one long context among short: cut it
    ([533] * 64, 64, 0),                         # even: nothing to cut
    ([533] * 60, 64, 0),                         # padded rows count one tile each
    ([2000] * 250, 256, 0),                      # all long: the share is long too
    ([4000] + [10] * 7, 8, plan.BALANCED),        # base 7 of a grid of 16
    ([700], 1, 0),                               # one sequence: its base is the whole grid
    ([4096] + [10] * 200, 256, plan.BALANCED),    # a large batch of short contexts and one long one
])
def test_pick_split_mode(lens, rows, want):
    cpu = torch.device("cpu")
    block_n = plan.decode_launch_settings().block_n  # the tiles the kernels walk, and the pick counts
    assert plan.pick_split_mode(lens, rows, 8, 4096, cpu) == want
    base, parts = _kernel_parts(lens, rows, 8, 4096, block_n)
    longest = max(lens)
    gain = -(-(-(-longest // block_n)) // base) - -(-(-(-longest // block_n)) // parts[lens.index(longest)])
    assert (gain > plan.BALANCED_MIN_GAIN_TILES) == (want == plan.BALANCED)


def test_graph_modes_follow_the_switch(monkeypatch):
    """Balanced: 0, BALANCED where the rows' grid has more splits than the base, and SLOTS where
    some lengths up to max_model_len can take the slots' grid (takes_slots); a split size: that
    alone."""
    cpu = torch.device("cpu")
    monkeypatch.setattr(plan, "decode_split_tokens", lambda: plan.BALANCED)
    assert plan.graph_split_modes(64, 8, 40960, cpu) == [0, plan.BALANCED, plan.SLOTS]
    assert plan.graph_split_modes(256, 8, 40960, cpu) == [0, plan.BALANCED, plan.SLOTS]
    # 4,096 positions: 32 tiles; at 64 rows chains of 11 in the rows' grid (3 splits) against 2 in
    # the slots' (16): a gain of 9, not the 12 takes_slots asks at 64 rows; at 256 rows 16 - 2 < 44
    assert plan.graph_split_modes(64, 8, 4096, cpu) == [0, plan.BALANCED]
    assert plan.graph_split_modes(256, 8, 4096, cpu) == [0, plan.BALANCED]
    # ... unless the switch lowers the bar, or the tiles are smaller (more of them)
    monkeypatch.setattr(plan, "slot_min_gain_tiles", lambda: -10 ** 6)
    assert plan.graph_split_modes(64, 8, 4096, cpu) == [0, plan.BALANCED, plan.SLOTS]
    monkeypatch.setattr(plan, "slot_min_gain_tiles", lambda: plan.SLOT_MIN_GAIN_TILES)
    assert plan.graph_split_modes(64, 8, 4096, cpu, block_n=16) == [0, plan.BALANCED, plan.SLOTS]
    assert plan.graph_split_modes(1, 8, 131072, cpu) == [0]                             # 49 all three
    assert plan.graph_split_modes(16, 8, 256, cpu) == [0]                               # no room to cut
    monkeypatch.setattr(plan, "decode_split_tokens", lambda: 512)
    assert plan.graph_split_modes(64, 8, 4096, cpu) == [512]


@pytest.mark.parametrize("raw, want", [
    ("", plan.DecodeLaunch()),
    ("base", plan.DecodeLaunch()),
    ("rows+nolpt+bn64", plan.DecodeLaunch(block_n=64, heads_fastest=False, longest_first=False)),
    ("w8+s2", plan.DecodeLaunch(num_warps=8, num_stages=2)),
])
def test_decode_launch_switch(monkeypatch, raw, want):
    monkeypatch.setenv(plan.DECODE_LAUNCH_ENV, raw)
    plan.decode_launch_settings.cache_clear()
    try:
        assert plan.decode_launch_settings() == want
    finally:
        plan.decode_launch_settings.cache_clear()


@pytest.mark.parametrize("raw", ["bn", "bn100", "rows+fast", "w0"])
def test_bad_decode_launch_names_it(raw):
    with pytest.raises(ValueError, match=plan.DECODE_LAUNCH_ENV):
        plan.parse_decode_launch(raw)


def test_pick_counts_the_switch_tiles(monkeypatch):
    """pick_split_mode counts tiles of the launch's BLOCK_N: one long sequence among short ones
    whose gain from cuts is more than BALANCED_MIN_GAIN_TILES tiles of 64 but not of 256."""
    lens, cpu = [900] + [200] * 63, torch.device("cpu")
    assert plan.pick_split_mode(lens, 64, 8, 4096, cpu, block_n=64) == plan.BALANCED
    assert plan.pick_split_mode(lens, 64, 8, 4096, cpu, block_n=256) == 0
    monkeypatch.setattr(plan, "decode_launch_settings", lambda: plan.DecodeLaunch(block_n=256))
    assert plan.pick_split_mode(lens, 64, 8, 4096, cpu) == 0


def _fresh_launches():
    plan.decode_launch_settings.cache_clear()
    plan.fp8_decode_launch_settings.cache_clear()


@pytest.mark.parametrize("bf16_env, fp8_env, constant, want", [
    # no switch: today's constant, on top of the bf16 launch
    (None, None, "", plan.DecodeLaunch()),
    (None, None, "bn256+f16", plan.DecodeLaunch(block_n=256, f16_dot=True)),
    # the fp8 switch replaces the constant; "base" is the bf16 launch itself
    (None, "base", "bn256+f16", plan.DecodeLaunch()),
    (None, "bn256+w8+s2+f16", "", plan.DecodeLaunch(block_n=256, num_warps=8, num_stages=2, f16_dot=True)),
    # the bf16 switch reaches fp8 caches too, under their own changes
    ("rows+w8", "bn256", "", plan.DecodeLaunch(block_n=256, num_warps=8, heads_fastest=False)),
])
def test_fp8_decode_launch_switch(monkeypatch, bf16_env, fp8_env, constant, want):
    for name, value in ((plan.DECODE_LAUNCH_ENV, bf16_env), (plan.DECODE_FP8_LAUNCH_ENV, fp8_env)):
        if value is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, value)
    monkeypatch.setattr(plan, "DECODE_FP8_LAUNCH", constant)
    _fresh_launches()
    try:
        assert plan.decode_launch_for(torch.float8_e4m3fn) == want
        # bf16 / fp16 / fp32 caches keep their own launch, which never casts to f16
        bf16 = plan.parse_decode_launch(bf16_env or "")
        for dtype in (torch.bfloat16, torch.float16, torch.float32, None):
            assert plan.decode_launch_for(dtype) == bf16
    finally:
        _fresh_launches()


def test_f16_is_an_fp8_launch_name_only():
    with pytest.raises(ValueError, match=plan.DECODE_LAUNCH_ENV):
        plan.parse_decode_launch("f16")
    with pytest.raises(ValueError, match=plan.DECODE_FP8_LAUNCH_ENV):
        plan.parse_decode_launch("bn256+fp16", fp8=True)
    with pytest.raises(ValueError, match=plan.DECODE_FP8_LAUNCH_ENV):
        plan.parse_decode_launch("bn96", fp8=True)
    assert plan.parse_decode_launch(plan.DECODE_FP8_LAUNCH, fp8=True).block_n >= 16  # the constant parses


def test_pick_counts_the_fp8_launch_tiles(monkeypatch):
    """A decode graph over an fp8 cache picks its split mode with the fp8 launch's tiles."""
    lens, cpu = [900] + [200] * 63, torch.device("cpu")
    monkeypatch.setattr(plan, "decode_launch_settings", lambda: plan.DecodeLaunch(block_n=64))
    monkeypatch.setattr(plan, "fp8_decode_launch_settings", lambda: plan.DecodeLaunch(block_n=256))
    assert plan.pick_split_mode(lens, 64, 8, 4096, cpu, kv_dtype=torch.bfloat16) == plan.BALANCED
    assert plan.pick_split_mode(lens, 64, 8, 4096, cpu, kv_dtype=torch.float8_e4m3fn) == 0


@pytest.mark.parametrize("raw, want", [("", plan.DECODE_SHARE_PROGRAMS_PER_SM), ("6", 6), ("1", 1)])
def test_share_switch_sets_the_balanced_plans_programs_per_sm(monkeypatch, raw, want):
    monkeypatch.setenv(plan.DECODE_SHARE_ENV, raw)
    plan.decode_share_per_sm.cache_clear()
    try:
        assert plan.balanced_share(torch.device("cpu"), 128) == (want * 132, plan.MIN_TOKENS_PER_SPLIT // 128)
    finally:
        plan.decode_share_per_sm.cache_clear()


def test_the_share_decides_whether_a_step_takes_the_balanced_cut(monkeypatch):
    # 8 rows x 8 KV heads: one 4,000-token sequence (32 tiles of 128) beside seven of 1,000 (8
    # tiles): 704 tiles of work; the base is 7 splits (cdiv(3 x 132, 64)), so its longest chain 5
    # tiles. At 2 per SM (264 programs) chains of 3 tiles cut the long one into 11: 3 tiles, a
    # gain of 2, not more than BALANCED_MIN_GAIN_TILES: no cut. At 6 (792) chains of 2 (the floor)
    # cut it into 16: 2 tiles, a gain of 3: the balanced graph.
    lens = [4000] + [1000] * 7
    for share, want in (("2", 0), ("6", plan.BALANCED)):
        monkeypatch.setenv(plan.DECODE_SHARE_ENV, share)
        plan.decode_share_per_sm.cache_clear()
        try:
            assert plan.pick_split_mode(lens, 8, 8, 8192, torch.device("cpu"), block_n=128) == want
        finally:
            plan.decode_share_per_sm.cache_clear()


@pytest.mark.parametrize("raw", ["0", "-2", "six", "4.5"])
def test_bad_share_switch_names_it(monkeypatch, raw):
    monkeypatch.setenv(plan.DECODE_SHARE_ENV, raw)
    plan.decode_share_per_sm.cache_clear()
    try:
        with pytest.raises(ValueError, match=plan.DECODE_SHARE_ENV):
            plan.decode_share_per_sm()
    finally:
        plan.decode_share_per_sm.cache_clear()


@pytest.mark.parametrize("raw, slots", [("", True), ("2", True), ("1000000", False), ("-1000000", True)])
def test_slot_gain_switch_decides_the_grid_of_a_skewed_step(monkeypatch, raw, slots):
    """PAGEDSERVE_DECODE_SLOT_GAIN moves the threshold of takes_slots (and so the graph a step
    replays): the measured mix's step (one 32k among 15 short ones, chains of
    29 tiles in the rows' grid against 6) takes the slots' grid unless the switch asks for more."""
    monkeypatch.setenv(plan.SLOT_GAIN_ENV, raw)
    plan.slot_min_gain_tiles.cache_clear()
    try:
        assert plan.takes_slots(256, 4, 4, 9, 49, 16) == slots
    finally:
        plan.slot_min_gain_tiles.cache_clear()
    monkeypatch.setenv(plan.SLOT_GAIN_ENV, "few")
    try:
        with pytest.raises(ValueError, match=plan.SLOT_GAIN_ENV):
            plan.slot_min_gain_tiles()
    finally:
        plan.slot_min_gain_tiles.cache_clear()
