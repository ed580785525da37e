"""PAGEDSERVE_PREFILL_LAUNCH and PAGEDSERVE_UNIFIED_LAUNCH: one grammar (tile_launch.py), each
switch's own defaults and flags, a ValueError naming the switch on bad input."""
import pytest

from pagedserve.attention import triton_prefill as prefill
from pagedserve.attention import triton_unified as unified
from pagedserve.attention.tile_launch import TileLaunch


@pytest.mark.parametrize("raw, want", [
    ("", prefill.PREFILL_DEFAULT),
    ("bm128+bn32+w8+s3", TileLaunch(128, 32, 8, 3)),
    ("gqa+bm128", TileLaunch(128, prefill.PREFILL_BLOCK_N, 4, 2, gqa=True)),
    ("lpt", TileLaunch(prefill.PREFILL_BLOCK_M, prefill.PREFILL_BLOCK_N, 4, 2, lpt=True)),
    (" s4 ", TileLaunch(prefill.PREFILL_BLOCK_M, prefill.PREFILL_BLOCK_N, 4, 4)),
])
def test_prefill_launch_switch_read_once(monkeypatch, raw, want):
    monkeypatch.setenv(prefill.PREFILL_LAUNCH_ENV, raw)
    prefill.prefill_launch.cache_clear()
    try:
        assert prefill.prefill_launch() == want
        monkeypatch.setenv(prefill.PREFILL_LAUNCH_ENV, "bm16")  # read once per process: no effect now
        assert prefill.prefill_launch() == want
    finally:
        prefill.prefill_launch.cache_clear()


@pytest.mark.parametrize("raw", ["bm48", "bn8", "x4", "w0", "bm", "gqa2", "lpt1", "bm64+fast"])
def test_bad_prefill_launch_names_the_switch(raw):
    with pytest.raises(ValueError, match=prefill.PREFILL_LAUNCH_ENV) as err:
        prefill.parse_prefill_launch(raw)
    assert "\n" not in str(err.value)


def test_launch_names_parse_back():
    for text in ("bm128+bn64+w8+s3+gqa", "bm64+bn128+w4+s2", "bm64+bn64+w4+s2+lpt", "bm128+bn64+w8+s3+gqa+lpt"):
        assert prefill.parse_prefill_launch(text).name(prefill.PREFILL_FLAGS) == text
    assert unified.parse_unified_launch("bm256+bn32+w8+s3").name() == "bm256+bn32+w8+s3"


@pytest.mark.parametrize("group, launch, want", [
    (4, TileLaunch(64, 64, 4, 2), (1, 64, False)),              # not packed: BLOCK_M query tokens
    (4, TileLaunch(128, 64, 4, 2, gqa=True), (4, 32, True)),    # 32 tokens x 4 heads
    (6, TileLaunch(64, 64, 4, 2, gqa=True), (8, 8, True)),      # a group of 6 padded to 8
    (1, TileLaunch(64, 64, 4, 2, gqa=True), (1, 64, False)),    # MHA: packing changes nothing
])
def test_prefill_rows(group, launch, want):
    assert prefill.prefill_rows(group, launch) == want


def test_gqa_tile_smaller_than_the_group_is_refused():
    with pytest.raises(ValueError, match=prefill.PREFILL_LAUNCH_ENV):
        prefill.prefill_rows(32, TileLaunch(16, 64, 4, 2, gqa=True))


def test_hopper_default_is_the_sweep_pick_and_the_switch_changes_it(monkeypatch):
    """On Hopper (head_dim <= 128) the default is the H200 sweep's pick, and the switch's parts
    change that default, not the small one."""
    sweep = prefill.PREFILL_DEFAULT_SM90
    assert sweep.name() == "bm128+bn128+w8+s4" and sweep != prefill.PREFILL_DEFAULT
    monkeypatch.setenv(prefill.PREFILL_LAUNCH_ENV, "")
    prefill.prefill_launch.cache_clear()
    try:
        assert prefill.prefill_launch(sm90=True) == sweep
        assert prefill.prefill_launch(sm90=False) == prefill.PREFILL_DEFAULT
    finally:
        prefill.prefill_launch.cache_clear()
    assert prefill.parse_prefill_launch("s2", sm90=True) == TileLaunch(128, 128, 8, 2)


@pytest.mark.parametrize("sm90, dtype, head_dim, want", [
    (True, "bfloat16", 128, prefill.PREFILL_DEFAULT_SM90),
    (True, "float16", 64, prefill.PREFILL_DEFAULT_SM90),
    (True, "float32", 128, prefill.PREFILL_DEFAULT),   # 4 stages of fp32 128 x 128 tiles overflow shared memory
    (True, "bfloat16", 256, prefill.PREFILL_DEFAULT),
    (False, "bfloat16", 128, prefill.PREFILL_DEFAULT),
])
def test_paged_prefill_takes_hopper_tiles_only_where_they_fit(monkeypatch, sm90, dtype, head_dim, want):
    """paged_prefill's launch without an override: Hopper's large tiles for 2-byte queries at
    head_dim <= 128, the small default elsewhere (the kernel itself is replaced: CPU only)."""
    import torch
    from pagedserve.attention import triton_ops
    monkeypatch.delenv(prefill.PREFILL_LAUNCH_ENV, raising=False)
    prefill.prefill_launch.cache_clear()
    monkeypatch.setattr(triton_ops, "_sm90", lambda device: sm90)
    seen = []
    monkeypatch.setattr(triton_ops, "prefill_attention", lambda *a: seen.append(a[11]))
    q = torch.zeros(4, 2, head_dim, dtype=getattr(torch, dtype))
    try:
        triton_ops.paged_prefill(q, q, q, None, None, None, 0, 1, 4, 1.0, q)
    finally:
        prefill.prefill_launch.cache_clear()
    assert seen == [want]
