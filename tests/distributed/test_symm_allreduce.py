"""The opt-in symmetric-memory all-reduce (runner/symm_allreduce.py): its switch, which tensors
take it, and the start-up agreement that keeps every rank on the same collective. The one-shot
kernel itself needs CUDA GPUs with P2P; here only what decides when it runs."""
from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from pagedserve import distributed
from pagedserve.distributed import TPGroup, all_reduce
from pagedserve.runner import symm_allreduce
from pagedserve.runner.dist_env import free_port


def test_switch_and_size_name_the_variable(monkeypatch):
    monkeypatch.setenv(symm_allreduce.SWITCH, "custom")
    with pytest.raises(ValueError, match="PAGEDSERVE_TP_ALLREDUCE must be one of nccl, symm_mem, got 'custom'"):
        symm_allreduce.requested()
    monkeypatch.setenv(symm_allreduce.MAX_MB, "-1")
    with pytest.raises(ValueError, match="PAGEDSERVE_TP_ALLREDUCE_MAX_MB must be > 0"):
        symm_allreduce.max_bytes()
    monkeypatch.setenv(symm_allreduce.MAX_MB, "0.5")
    assert symm_allreduce.max_bytes() == 2**19


class _Recorder:
    """Stands in for the fast path: the tensors it fits (at most `limit` elements) are 'reduced'
    by doubling (two equal ranks) and recorded."""

    def __init__(self, limit: int) -> None:
        self.limit, self.calls = limit, []

    def fits(self, x):
        return x.numel() <= self.limit

    def __call__(self, x):
        self.calls.append(x.numel())
        return x.mul_(2)


@pytest.fixture
def one_rank_gloo():
    store = dist.HashStore()
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


def test_only_tensors_the_fast_path_fits_take_it(monkeypatch, one_rank_gloo):
    fast = _Recorder(limit=8)
    # A TP group of size 2 whose real collective is a one-rank gloo group: what NCCL would get
    # comes back unchanged, what the fast path gets comes back doubled.
    monkeypatch.setattr(distributed, "_TP_GROUP", TPGroup(rank=0, size=2, group=one_rank_gloo,
                                                          fast_all_reduce=fast))
    small, large = torch.ones(8), torch.ones(9)
    assert torch.equal(all_reduce(small), torch.full((8,), 2.0))
    assert torch.equal(all_reduce(large), torch.ones(9))
    assert fast.calls == [8]


def test_switch_off_or_one_rank_installs_nothing(monkeypatch):
    monkeypatch.delenv(symm_allreduce.SWITCH, raising=False)
    assert symm_allreduce.install(None, 0, 2, torch.device("cuda"), torch.bfloat16) is None
    monkeypatch.setenv(symm_allreduce.SWITCH, "symm_mem")
    assert symm_allreduce.install(None, 0, 1, torch.device("cuda"), torch.bfloat16) is None


class _Marker:
    def __init__(self, name: str) -> None:
        self.name, self.buffer = name, torch.empty(4)


# (ranks whose own set-up succeeds, what each rank installs): all, one, none.
AGREEMENT_CASES = [((0, 1), ["reducer of rank 0", "reducer of rank 1"]), ((0,), [None, None]), ((), [None, None])]


def _rank(rank: int, port: int, results) -> None:
    os.environ[symm_allreduce.SWITCH] = "symm_mem"
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        marker = _Marker(f"reducer of rank {rank}")
        for i, (succeed_on, _) in enumerate(AGREEMENT_CASES):  # both ranks, in the same order
            # What each rank's own set-up gives; the real one needs CUDA, so it is replaced here.
            symm_allreduce._set_up = lambda *a, ok=rank in succeed_on: (marker, None) if ok else (None, "no P2P here")
            # A CUDA device in name only: _set_up, which would use it, is replaced; the agreement runs
            # on this gloo group with a CPU tensor.
            got = symm_allreduce.install(dist.group.WORLD, rank, 2, torch.device("cuda", rank), torch.float32)
            results[(i, rank)] = None if got is None else got.name
    finally:
        dist.destroy_process_group()


def test_every_rank_uses_it_or_none_does():
    """Each case is one install() on both ranks; the cases share one pair of spawned ranks (a pair
    costs ~2 s to start, and each install is its own agreement: nothing carries over)."""
    ctx = mp.get_context("spawn")
    with ctx.Manager() as manager:
        results = manager.dict()
        port = free_port()
        procs = [ctx.Process(target=_rank, args=(r, port, results)) for r in range(2)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(60)
            assert p.exitcode == 0
        for i, (succeed_on, want) in enumerate(AGREEMENT_CASES):
            assert [results[(i, 0)], results[(i, 1)]] == want, succeed_on


@pytest.mark.parametrize("device, dtype", [("cpu", torch.float32), ("cuda", torch.float16)])
def test_cpu_or_another_dtype_declines_on_every_rank_alike(monkeypatch, caplog, device, dtype):
    """No collective needed: every rank has the same device kind and dtype (group None would fail)."""
    monkeypatch.setenv(symm_allreduce.SWITCH, "symm_mem")
    with caplog.at_level("WARNING"):
        got = symm_allreduce.install(None, 0, 2, torch.device(device), dtype)
    assert got is None
    assert f"here {device}, {dtype}" in caplog.text
