"""The decode grid's split count and the PAGEDSERVE_DECODE_SPLIT_TOKENS switch (host side of
triton_decode.split_plan; the kernels themselves are checked in triton_interpret_cases.py)."""
import pytest

from pagedserve.attention import triton_ops as ops


def test_grid_fits_the_longest_sequence_at_split_tokens():
    assert ops.grid_splits(1, 4096, 512) == 8        # a 64-sequence decode graph: base 1
    assert ops.grid_splits(12, 4096, 512) == 12      # a small batch already asks for more
    assert ops.grid_splits(1, 300, 512) == 1         # eager, short contexts: nothing to cut
    assert ops.grid_splits(3, 4096, 0) == 3          # off: the base alone
    assert ops.grid_splits(1, 10 ** 6, 512) == ops.MAX_SPLITS


@pytest.mark.parametrize("raw, want", [("", ops.DECODE_SPLIT_TOKENS), ("0", 0), ("1024", 1024)])
def test_switch(monkeypatch, raw, want):
    monkeypatch.setenv(ops.SPLIT_TOKENS_ENV, raw)
    ops.decode_split_tokens.cache_clear()
    try:
        assert ops.decode_split_tokens() == want
    finally:
        ops.decode_split_tokens.cache_clear()


@pytest.mark.parametrize("raw", ["-1", "lots"])
def test_bad_switch_names_it(monkeypatch, raw):
    monkeypatch.setenv(ops.SPLIT_TOKENS_ENV, raw)
    ops.decode_split_tokens.cache_clear()
    try:
        with pytest.raises(ValueError, match=ops.SPLIT_TOKENS_ENV):
            ops.decode_split_tokens()
    finally:
        ops.decode_split_tokens.cache_clear()
