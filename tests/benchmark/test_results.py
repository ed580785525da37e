"""pagedserve.benchmark.results: the commit is this checkout's or a stamp's that still matches the
source, never another repository's; every result carries commit, date, command, device, switches."""
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from pagedserve.benchmark import results
from pagedserve.config import EngineConfig

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "pagedserve"


def _git(cwd: Path, *args: str) -> str:
    return subprocess.check_output(["git", *args], cwd=cwd, text=True).strip()


def _other_repo(path: Path) -> str:
    """A fresh repository with one commit; returns that commit."""
    path.mkdir(parents=True, exist_ok=True)
    _git(path, "init", "-q")
    (path / "f.txt").write_text("x\n")
    _git(path, "add", "f.txt")
    _git(path, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "other")
    return _git(path, "rev-parse", "HEAD")


def _copy_package(dest: Path) -> Path:
    shutil.copytree(PACKAGE, dest / "pagedserve", ignore=shutil.ignore_patterns("__pycache__", "demo_model",
                                                                             results.STAMP_NAME))
    return dest / "pagedserve"


def test_commit_is_this_checkouts_head_whatever_the_cwd(tmp_path, monkeypatch):
    head = _git(ROOT, "rev-parse", "HEAD")
    other = _other_repo(tmp_path / "other")
    monkeypatch.chdir(tmp_path / "other")
    monkeypatch.setenv("GIT_DIR", str(tmp_path / "other" / ".git"))
    commit = results.git_commit()
    assert commit.removesuffix("+dirty") == head and other not in commit


@pytest.mark.parametrize("where", [".", "nested/deeper"])
def test_copy_inside_another_repository_refuses(tmp_path, where):
    other = tmp_path / "other"
    _other_repo(other)
    copy = _copy_package(other / where)
    with pytest.raises(results.UnknownCommitError, match="neither in a git checkout nor stamped"):
        results.git_commit(copy)


def test_stamp_names_the_commit_until_the_source_changes(tmp_path):
    copy = _copy_package(tmp_path)
    results.write_stamp(copy, commit="abc123")
    assert results.git_commit(copy) == "abc123"
    (copy / "config.py").write_text((copy / "config.py").read_text() + "\n# edited after stamping\n")
    with pytest.raises(results.UnknownCommitError, match="changed since it was stamped"):
        results.git_commit(copy)


def test_matching_stamp_wins_over_a_stale_dirty_checkout(tmp_path):
    """A copy of the tree that travels with an old .git (as the GPU machine's did): the checkout is
    dirty against that old HEAD, and the stamp made for this source names the code."""
    copy = _copy_package(tmp_path)
    _git(tmp_path, "init", "-q")
    _git(tmp_path, "add", "pagedserve")
    _git(tmp_path, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "stale")
    stale = _git(tmp_path, "rev-parse", "HEAD")
    (copy / "config.py").write_text((copy / "config.py").read_text() + "\n# newer than the stale HEAD\n")
    assert results.git_commit(copy) == stale + "+dirty"
    results.write_stamp(copy, commit="fresh123")
    assert results.git_commit(copy) == "fresh123"
    (copy / "config.py").write_text((copy / "config.py").read_text() + "\n# and edited after stamping\n")
    assert results.git_commit(copy) == stale + "+dirty"


def test_new_package_file_under_a_stale_clean_checkout_is_dirty_and_the_stamp_names_it(tmp_path):
    """The GPU machine's stale .git saw a tuned table added since its HEAD only as an untracked file, so
    results named the old commit: an untracked package file now makes the checkout dirty, the stamp
    (whose hash covers JSON data) names the code, and editing that table invalidates the stamp."""
    copy = _copy_package(tmp_path)
    _git(tmp_path, "init", "-q")
    _git(tmp_path, "add", "pagedserve")
    _git(tmp_path, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "stale")
    stale = _git(tmp_path, "rev-parse", "HEAD")
    assert results.git_commit(copy) == stale
    table = copy / "layers" / "fused_moe" / "configs" / "E=8,H=64,I=128,dtype=bfloat16,device=X.json"
    table.parent.mkdir(parents=True, exist_ok=True)
    table.write_text('{"1": {"BLOCK_M": 16}}\n')
    assert results.git_commit(copy) == stale + "+dirty"
    results.write_stamp(copy, commit="tuned123")
    assert results.git_commit(copy) == "tuned123"
    table.write_text('{"1": {"BLOCK_M": 32}}\n')
    assert results.git_commit(copy) == stale + "+dirty"


def test_stamp_command_in_a_checkout_records_head(tmp_path):
    head = _git(ROOT, "rev-parse", "HEAD")
    copy = _copy_package(tmp_path)
    stamp = results.write_stamp(copy, commit=results.git_commit())
    assert json.loads(stamp.read_text())["commit"].removesuffix("+dirty") == head


def test_write_result_records_provenance_and_switches(tmp_path, monkeypatch):
    monkeypatch.setenv("PAGEDSERVE_FUSED", "0")
    monkeypatch.delenv("PAGEDSERVE_ATTENTION", raising=False)
    cfg = EngineConfig(model="m", enable_prefix_caching=False, preemption_mode="swap")
    out = tmp_path / "cpu" / "x.json"
    doc = results.write_result(out, "x", "python bench.py --a 1", {"k": 1}, {"tok_per_s": 3.5}, None,
                               {"r": 2.0}, device="cpu", switches=results.engine_switches(cfg))
    on_disk = json.loads(out.read_text())
    assert on_disk == doc
    assert list(on_disk)[:len(results.RESULT_KEYS)] == list(results.RESULT_KEYS)
    assert on_disk["commit"] == results.git_commit() and on_disk["device"] == "cpu"
    assert on_disk["command"] == "python bench.py --a 1"
    sw = on_disk["switches"]
    assert sw["PAGEDSERVE_FUSED"] == "0" and sw["PAGEDSERVE_ATTENTION"] is None
    assert sw["enable_prefix_caching"] is False and sw["preemption_mode"] == "swap"
    assert sw["enforce_eager"] is False and sw["kv_allocator"] == "paged"
    assert on_disk["versions"]["python"] == sys.version.split()[0]
    assert on_disk["host"]["logical_cpus"] == os.cpu_count() and on_disk["host"]["python_loop_ms"] > 0
    md = out.with_suffix(".md").read_text()
    assert "| tok_per_s | 3.5 |" in md and "| ratio.r | 2.0 |" in md and "PAGEDSERVE_FUSED=0" in md


def test_write_result_records_the_kernels_this_process_picked(tmp_path):
    import torch

    from pagedserve.attention.backend import get_backend
    from pagedserve.layers import fused
    fused.reset()
    get_backend(torch.device("cpu"))
    fused.fused_ops(torch.device("cpu"))
    doc = results.write_result(tmp_path / "y.json", "y", None, {}, {}, device="cpu")
    assert doc["switches"]["fused_layer_ops"] == {"cpu": "torch"}
    assert doc["switches"]["attention_kernels"]["cpu"] == "reference"
    assert doc["command"].startswith("python ")


def test_write_result_dates_a_result_by_its_runs_when_told(tmp_path):
    import datetime
    def today():
        return datetime.datetime.now(datetime.timezone.utc).date().isoformat()
    before = today()  # (either side of a midnight that falls inside the call)
    assert results.write_result(tmp_path / "a.json", "a", "cmd", {}, {}, device="cpu")["date"] in {before, today()}
    doc = results.write_result(tmp_path / "b.json", "b", "cmd", {}, {}, device="cpu", date="2026-12-04")
    assert doc["date"] == json.loads((tmp_path / "b.json").read_text())["date"] == "2026-12-04"
    with pytest.raises(ValueError):  # not a day: refused before anything is written
        results.write_result(tmp_path / "c.json", "c", "cmd", {}, {}, device="cpu", date="12/04/2026")
    assert not (tmp_path / "c.json").exists()


def test_write_result_refuses_without_a_commit(tmp_path, monkeypatch):
    copy = _copy_package(tmp_path / "plain")
    monkeypatch.setattr(results, "PACKAGE_DIR", copy)
    with pytest.raises(results.UnknownCommitError):
        results.write_result(tmp_path / "z.json", "z", "cmd", {}, {}, device="cpu")
    assert not (tmp_path / "z.json").exists()


def test_built_package_carries_its_commit(tmp_path):
    """setup.py's build_py stamps the built copy, which then names the commit outside any checkout."""
    (tmp_path / "egg").mkdir()
    proc = subprocess.run([sys.executable, "setup.py", "-q", "egg_info", "--egg-base", str(tmp_path / "egg"),
                           "build_py", "--build-lib", str(tmp_path / "lib")],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert results.git_commit(tmp_path / "lib" / "pagedserve") == results.git_commit()
