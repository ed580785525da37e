"""What the kernel tuners share (benchmarks/kernels/graph_timing.py) and the MoE tuner's table
entries as the layer reads them. The FP8 GEMM tuner's entries: test_fp8_gemm_dispatch.py."""
import math
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks" / "kernels"))

import graph_timing  # noqa: E402
from pagedserve.layers.fused_moe import config as moe_config  # noqa: E402
from pagedserve.layers.tuned_tables import write_table  # noqa: E402

CPU = torch.device("cpu")


def test_fastest_puts_graph_timed_candidates_first():
    """A launch-timed time carries host cost a graph-timed one does not: it wins only alone."""
    a, b, c, d = (dict(name=x) for x in "abcd")
    assert graph_timing.fastest([(a, 5.0, "launch"), (b, 9.0, "graph"), (c, 7.0, "graph"), (d, 7.0, "graph")]) \
        == (c, 7.0, "graph")
    assert graph_timing.fastest([(a, 5.0, "launch"), (b, 4.0, "launch")]) == (b, 4.0, "launch")
    assert graph_timing.fastest([]) is None


def test_weight_copies_reach_the_graph_bytes():
    """Llama-3.1-8B's o_proj (16 MB fp8 + scales) takes 16 copies, gate_up (117 MB) 3: each the
    fewest whose bytes reach WEIGHT_BYTES_PER_GRAPH; a tiny weight stops at MAX_COPIES."""
    total = graph_timing.WEIGHT_BYTES_PER_GRAPH
    for n, k, want in ((4096, 4096, 16), (28672, 4096, 3), (4096, 14336, 5), (6144, 4096, 11)):
        nbytes = n * k + 4 * n
        assert graph_timing.copies_for(nbytes) == want
        assert want * nbytes >= total > (want - 1) * nbytes
    assert graph_timing.copies_for(2 * total) == 1
    w, s = torch.arange(8, dtype=torch.float32), torch.ones(2)
    copies = graph_timing.cold_copies((w, s))
    assert len(copies) == graph_timing.MAX_COPIES and copies[0][0] is w
    assert len({c[0].data_ptr() for c in copies}) == len(copies)  # each launch its own memory
    assert all(torch.equal(c[0], w) and torch.equal(c[1], s) for c in copies)


@pytest.fixture
def moe_table_dir(tmp_path, monkeypatch):
    monkeypatch.setattr(moe_config, "CONFIG_DIR", tmp_path)
    for cached in (moe_config.load_table, moe_config._get_config):
        cached.cache_clear()
    yield tmp_path
    for cached in (moe_config.load_table, moe_config._get_config):
        cached.cache_clear()


def test_moe_tuner_entries_give_the_layer_its_block_sizes(moe_table_dir):
    """tune_fused_moe adds each entry's time and how it was taken; the layer reads only KEYS."""
    import tune_fused_moe
    cfg = dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, GROUP_M=1, num_warps=4, num_stages=3)
    path = moe_table_dir / moe_config.config_file_name(8, 64, 32, torch.bfloat16, "cpu")
    write_table(path, {"64": tune_fused_moe.table_entry(dict(cfg, BLOCK_M=32), 80.0, "launch"),
                       "1": tune_fused_moe.table_entry(cfg, 41.234, "graph")})
    assert path.read_text().index('"1"') < path.read_text().index('"64"')  # token-count order
    assert moe_config.get_config(2, 8, 64, 32, 2, torch.bfloat16, CPU) == cfg
    assert moe_config.get_config(50, 8, 64, 32, 2, torch.bfloat16, CPU) == dict(cfg, BLOCK_M=32)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_timed_us_graphs_what_captures_and_times_launches_of_what_does_not():
    copies = graph_timing.cold_copies((torch.randn(1024, 1024, device="cuda"),))
    us, how = graph_timing.timed_us(lambda w: w[0].sum(), copies)
    assert how == "graph" and math.isfinite(us) and us > 0
    us, how = graph_timing.timed_us(lambda w: w[0].sum().item(), copies)  # a host read: not capturable
    assert how == "launch" and math.isfinite(us) and us > 0
    us, how = graph_timing.timed_us(lambda w: w[0].sum(), copies)  # the device is fine after a failed capture
    assert how == "graph"
