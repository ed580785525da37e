"""The process's TP group has one owner (pagedserve.distributed): the runtime installs it and its
teardown gives back the single-rank group through that module's own functions."""
import pytest

from pagedserve.distributed import get_tp_group, init_tp_group
from pagedserve.runner.dist_groups import destroy_distributed


def test_teardown_gives_back_the_single_rank_group():
    marker = object()
    try:
        init_tp_group(1, 2, marker)
        g = get_tp_group()
        assert (g.rank, g.size, g.group) == (1, 2, marker)
    finally:
        destroy_distributed()
    g = get_tp_group()
    assert (g.rank, g.size, g.group) == (0, 1, None)


def test_rank_outside_the_group_is_a_value_error():
    with pytest.raises(ValueError, match=r"tp rank must be in \[0, 2\), got 2"):
        init_tp_group(2, 2)
    assert get_tp_group().size == 1
