"""PAGEDSERVE_FP8_GEMM's choice between cuBLASLt and the Triton GEMM (fp8_ops.uses_triton) and the
config tables it reads (fp8_gemm_config): pure host logic, checked on CPU with a table written here."""
import json
import sys
from pathlib import Path

import pytest
import torch

from pagedserve.layers.quant import fp8_gemm_config as cfgmod
from pagedserve.layers.quant import fp8_ops
from pagedserve.layers.tuned_tables import write_table

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks" / "kernels"))  # the tuner

CPU = torch.device("cpu")
ENTRY = dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=128, GROUP_M=1, SPLIT_K=4, num_warps=4, num_stages=4)


@pytest.fixture
def mode(monkeypatch):
    def set_mode(value):
        monkeypatch.setattr(fp8_ops, "_GEMM_MODE", None)
        if value is None:
            monkeypatch.delenv(fp8_ops.GEMM_ENV, raising=False)
        else:
            monkeypatch.setenv(fp8_ops.GEMM_ENV, value)
        return fp8_ops.gemm_mode()
    yield set_mode
    monkeypatch.setattr(fp8_ops, "_GEMM_MODE", None)


@pytest.fixture
def table_dir(tmp_path, monkeypatch):
    monkeypatch.setattr(cfgmod, "CONFIG_DIR", tmp_path)
    for cached in (cfgmod.load_table, cfgmod._get_config, cfgmod._triton_wins):
        cached.cache_clear()
    yield tmp_path
    for cached in (cfgmod.load_table, cfgmod._get_config, cfgmod._triton_wins):
        cached.cache_clear()


def test_default_is_the_one_constant_and_bad_values_name_the_variable(mode):
    assert mode(None) == fp8_ops.DEFAULT_GEMM == "auto"
    assert mode(" Auto ") == "auto"
    with pytest.raises(ValueError, match=r"PAGEDSERVE_FP8_GEMM must be one of cublas, triton, auto, got 'cutlass'"):
        mode("cutlass")


def test_fixed_modes_ignore_the_token_count(mode, table_dir):
    mode("cublas")
    assert not any(fp8_ops.uses_triton(m, 4096, 4096, CPU) for m in (1, 64, 4096))
    mode("triton")
    assert all(fp8_ops.uses_triton(m, 4096, 4096, CPU) for m in (1, 64, 4096))


def test_auto_without_a_table_runs_triton_up_to_the_threshold(mode, table_dir):
    mode("auto")
    t = cfgmod.AUTO_MAX_M
    assert [fp8_ops.uses_triton(m, 4096, 4096, CPU) for m in (1, t, t + 1, 4096)] == [True, True, False, False]


def test_auto_follows_the_tables_timings_per_bucket(mode, table_dir):
    """Buckets 1, 8, 32, 64: Triton faster at 1 and 64, slower at 8, untimed at 32 (the threshold
    decides); m takes the smallest bucket >= m; beyond the last bucket (a tuning run cut short)
    the heuristics decide, the Triton-or-not threshold included."""
    raw = {"1": dict(ENTRY, triton_us=10.0, cublas_us=18.0), "8": dict(ENTRY, triton_us=20.0, cublas_us=18.0),
           "32": dict(ENTRY, BLOCK_M=32), "64": dict(ENTRY, BLOCK_M=64, SPLIT_K=1, triton_us=14.0, cublas_us=15.0)}
    (table_dir / cfgmod.config_file_name(6144, 4096, "cpu")).write_text(json.dumps(raw))
    mode("auto")
    got = {m: fp8_ops.uses_triton(m, 6144, 4096, CPU) for m in (1, 2, 8, 9, 32, 33, 64, 65, 9999)}
    assert got == {1: True, 2: False, 8: False, 9: True, 32: True, 33: True, 64: True, 65: False, 9999: False}
    # Configs: the same buckets, only the kernel keys; the heuristics beyond.
    assert cfgmod.get_config(2, 6144, 4096, CPU) == ENTRY
    assert cfgmod.get_config(33, 6144, 4096, CPU) == dict(ENTRY, BLOCK_M=64, SPLIT_K=1)
    assert cfgmod.get_config(65, 6144, 4096, CPU) == cfgmod.default_config(128, 6144, 4096)
    assert cfgmod.get_config(9999, 6144, 4096, CPU) == cfgmod.default_config(9999, 6144, 4096)
    # Another shape has no table: the heuristics.
    assert cfgmod.get_config(1, 4096, 4096, CPU) == cfgmod.default_config(1, 4096, 4096)
    # The warm-up meets every bucket: the table's, then the heuristics' beyond it.
    assert cfgmod.warmup_token_counts(6144, 4096, CPU, 300) == [1, 8, 32, 64, 128, 256, 300]
    assert cfgmod.warmup_token_counts(4096, 4096, CPU, 40) == [1, 2, 4, 8, 16, 32, 40]


def test_the_tuners_entries_drive_auto(mode, table_dir):
    """tune_fp8_gemm's entries as it writes them: the kernel's keys, both times (rounded) and how
    they were timed (a string the reader skips); auto follows the times, the kernel gets its keys."""
    from tune_fp8_gemm import table_entry
    name = cfgmod.config_file_name(4096, 4096, "cpu")
    wide = dict(ENTRY, BLOCK_N=64)
    write_table(table_dir / name, {"16": table_entry(wide, 19.0, 17.0, "launch"),
                                   "1": table_entry(ENTRY, 11.004, 17.3, "graph")})
    assert list(json.loads((table_dir / name).read_text())) == ["1", "16"]
    assert json.loads((table_dir / name).read_text())["1"]["timing"] == "graph"
    mode("auto")
    assert [fp8_ops.uses_triton(m, 4096, 4096, CPU) for m in (1, 2, 16, 17)] == [True, False, False, True]
    assert cfgmod.get_config(1, 4096, 4096, CPU) == ENTRY
    assert cfgmod.get_config(9, 4096, 4096, CPU) == wide
    assert cfgmod.load_table(name)[1] == dict(ENTRY, triton_us=11.0, cublas_us=17.3)


def test_a_table_entry_missing_a_key_is_an_error(table_dir):
    bad = {k: v for k, v in ENTRY.items() if k != "SPLIT_K"}
    (table_dir / cfgmod.config_file_name(8, 8, "cpu")).write_text(json.dumps({"1": bad}))
    with pytest.raises(ValueError, match="SPLIT_K"):
        cfgmod.get_config(1, 8, 8, CPU)


def test_result_files_record_the_gemm_that_ran(mode, monkeypatch):
    """Beside the env value (None when unset), engine_switches says which GEMM setting was read:
    the default may flip, so an unset variable alone would not say."""
    from pagedserve.benchmark.results import engine_switches
    monkeypatch.setattr(fp8_ops, "_GEMM_MODE", None)
    assert "fp8_gemm" not in engine_switches()  # no FP8 GEMM ran in this process yet
    mode(None)
    sw = engine_switches()
    assert sw["PAGEDSERVE_FP8_GEMM"] is None and sw["fp8_gemm"] == fp8_ops.DEFAULT_GEMM
    mode("auto")
    assert engine_switches()["fp8_gemm"] == "auto"
