"""The tensor-parallel shutdown order on every rank: CUDA graphs first, then the process groups.

On CUDA, NCCL's destroy waits until every graph that captured one of its collectives is gone,
so a rank that destroys its groups with its decode graphs alive never returns (the 2xH200
"TP=2 hang"). CPU cannot capture graphs; these tests pin the order both halves follow."""
from types import SimpleNamespace

import torch

from pagedserve.runner import executor as executor_mod
from pagedserve.runner import tp_worker
from pagedserve.runner.executor import MultiProcExecutor


class RecordingWorker:
    def __init__(self, events):
        self.events = events
        self.rank, self._debug, self._t0 = 1, False, 0.0

    def release_cuda_graphs(self, synchronize=True):
        self.events.append("release graphs" + ("" if synchronize else " (no sync)"))


def bare_executor(events, monkeypatch) -> MultiProcExecutor:
    """Rank 0's executor with only what _teardown reads; the group teardown is recorded."""
    ex = MultiProcExecutor.__new__(MultiProcExecutor)
    ex._closed, ex._t0, ex._saved_threads, ex._startup_dir = False, 0.0, torch.get_num_threads(), None
    ex.worker = RecordingWorker(events)
    monkeypatch.setattr(executor_mod, "destroy_distributed",
                        lambda wait_s=None, abort_on_timeout=False, groups=None: events.append(f"destroy groups (bounded {wait_s} s)"))
    return ex


def test_worker_releases_graphs_after_the_barrier_and_before_leaving_its_loop(monkeypatch):
    events = []
    monkeypatch.setattr(tp_worker, "recv_command", lambda groups: tp_worker.Command(tp_worker.SHUTDOWN, seq=7))
    monkeypatch.setattr(tp_worker.dist, "barrier", lambda group=None: events.append("barrier"))
    worker = RecordingWorker(events)
    worker.groups = SimpleNamespace(control=None)
    tp_worker.worker_loop(worker)
    # run_worker destroys the groups only once worker_loop has returned (its finally clause).
    assert events == ["barrier", "release graphs"]


def test_rank0_graceful_teardown_releases_graphs_then_destroys_groups_then_reaps(monkeypatch):
    events = []
    ex = bare_executor(events, monkeypatch)
    monkeypatch.setattr(MultiProcExecutor, "_kill_workers", lambda self, grace_s=0.0: events.append("reap workers"))
    ex._teardown(graceful=True)
    assert events == ["release graphs", f"destroy groups (bounded {executor_mod.TEARDOWN_WAIT_S} s)", "reap workers"]
    assert ex._closed


def test_rank0_failed_teardown_releases_graphs_unsynchronized_before_the_abort(monkeypatch):
    events = []
    ex = bare_executor(events, monkeypatch)
    monkeypatch.setattr(MultiProcExecutor, "_kill_workers", lambda self, grace_s=0.0: events.append("kill workers"))
    monkeypatch.setattr(MultiProcExecutor, "_abort_nccl", lambda self, wait_s=5.0: events.append("abort nccl"))
    ex._teardown(graceful=False)
    # A graph may still be stuck in a collective: no device sync, and the abort comes after it.
    assert events == ["kill workers", "release graphs (no sync)", "abort nccl", "destroy groups (bounded 10.0 s)"]

