"""Before the first start-up phase (spawn, store, control group, set device, compute group) no wait
is unbounded: a rank stuck there fails the engine within the start-up bound, with an error naming
the rank and its sub-step; every rank's stacks reach stderr, and with PAGEDSERVE_TP_DEBUG=1 each
rank prints one line per sub-step, so the log of a hung engine is never empty."""
import os
import re
import time

import pytest

from pagedserve import LLM
from pagedserve.runner.executor import TensorParallelError
from pagedserve.runner.tp_startup import BACKSTOP_MARGIN_S, DEBUG_ENV, FAIL_ENV
from tp_helpers import launch_children

KW = dict(device="cpu", block_size=8, max_num_batched_tokens=64, max_num_seqs=8, num_gpu_blocks_override=32)


def _start_stuck(monkeypatch, model: str, substep: str, bound_s: int) -> tuple[TensorParallelError, float]:
    monkeypatch.setenv(FAIL_ENV, f"1:{substep}:hang")  # rank 1 stays alive and silent at that sub-step
    monkeypatch.setenv("PAGEDSERVE_TP_PHASE_TIMEOUT", str(bound_s))  # the pre-phase bound follows it
    monkeypatch.setenv(DEBUG_ENV, "1")
    t0 = time.monotonic()
    with pytest.raises(TensorParallelError) as info:
        LLM(model, **KW, tensor_parallel_size=2)
    return info.value, time.monotonic() - t0


@pytest.mark.timeout(90)
def test_worker_that_never_joins_the_store_fails_naming_rank_and_substep(tiny_model_dir, monkeypatch, capfd):
    err, took = _start_stuck(monkeypatch, str(tiny_model_dir("llama")), "join store", 5)
    msg = str(err)
    assert "rank(s) [1] did not join the store" in msg
    assert "rank 1 is at sub-step join store" in msg
    assert took < 60  # the bound (5 s) plus start-up, far below the 600 s PAGEDSERVE_TP_START_TIMEOUT
    log = capfd.readouterr().err
    # The worker's stacks (SIGUSR1 from rank 0's dump) show it at the hook, and rank 0's its own.
    assert "_maybe_hang" in log and "tensor-parallel rank 0 stacks" in log
    assert re.search(r"pagedserve tp \S+ rank 1 \+[\d.]+s: join store", log)
    assert re.search(r"pagedserve tp \S+ rank 0 \+[\d.]+s: spawn", log)
    assert not launch_children(os.getpid())


@pytest.mark.timeout(90)
def test_worker_stuck_creating_the_compute_group_fails_naming_rank_and_substep(tiny_model_dir, monkeypatch,
                                                                              capfd):
    # 8 s: room for rank 1 to import torch on a loaded 2-core machine (the same bound the start-up
    # phase tests and the idle test below give that import).
    err, took = _start_stuck(monkeypatch, str(tiny_model_dir("llama")), "compute group", 8)
    msg = str(err)
    assert "start-up phase init_runner did not finish" in msg
    assert "rank(s) [1] in init_runner" in msg
    assert "rank 1 is at sub-step compute group" in msg
    # Rank 0 got there too and waits for rank 1 inside the group's creation.
    assert "rank 0 is at sub-step compute group" in msg
    assert took < 60
    log = capfd.readouterr().err
    # faulthandler's timed dump (a C thread: it works even if the main thread holds the GIL) or the
    # watchdog's SIGUSR1 dump: either way the worker's stack shows where it is.
    assert "_maybe_hang" in log and "init_compute" in log
    assert ": control group" in log and ": compute group" in log
    assert not launch_children(os.getpid())


def test_startup_bound_is_the_start_timeout_when_set_else_follows_the_phase_bound(monkeypatch):
    from pagedserve.runner.tp_startup import startup_bound
    monkeypatch.delenv("PAGEDSERVE_TP_START_TIMEOUT", raising=False)
    monkeypatch.delenv("PAGEDSERVE_TP_PHASE_TIMEOUT", raising=False)
    assert startup_bound() == 600
    monkeypatch.setenv("PAGEDSERVE_TP_PHASE_TIMEOUT", "5")
    assert startup_bound() == 5  # lowering only the phase bound lowers it too
    monkeypatch.setenv("PAGEDSERVE_TP_START_TIMEOUT", "8")
    assert startup_bound() == 8  # set, it bounds the start-up alone, above the phases' bound
    monkeypatch.setenv("PAGEDSERVE_TP_PHASE_TIMEOUT", "900")
    assert startup_bound() == 8


@pytest.mark.timeout(60)
def test_watchdog_store_answers_while_the_main_connection_waits_in_a_rendezvous():
    """A group's rendezvous blocks in the store for a missing peer; the watchdog must still read
    progress then, so it reads through its own connection."""
    import threading
    from datetime import timedelta

    import torch.distributed as dist

    from pagedserve.runner.dist_env import DistEnv, free_port
    from pagedserve.runner.dist_groups import side_store

    env = DistEnv(rank=0, world_size=2, local_rank=0, master_addr="127.0.0.1", master_port=free_port(),
                  external=False)
    tcp = dist.TCPStore(env.master_addr, env.master_port, None, is_master=True, timeout=timedelta(seconds=2),
                        wait_for_workers=False)
    main = dist.PrefixStore("pagedserve", tcp)
    main.set("progress/1", "x")

    def order_of(reader) -> list[str]:
        events, waiting = [], threading.Event()

        def wait_for_peer():  # what a rendezvous does for a rank that never arrives
            waiting.set()
            try:
                main.get("never-set")
            except Exception:
                pass
            events.append("wait failed")
        t = threading.Thread(target=wait_for_peer)
        t.start()
        waiting.wait()
        time.sleep(0.5)  # inside the 2 s wait
        reader.check(["progress/1"])
        events.append("read")
        t.join()
        return events

    # (Through `main` itself the read may queue behind the wait: whether it does depends on the
    # client's timing, which is why the watchdog never shares that connection.)
    assert order_of(side_store(env)) == ["read", "wait failed"]


@pytest.mark.timeout(120)
def test_idle_engine_outlives_the_startup_bound(tiny_model_dir, monkeypatch):
    """The control group is created under the start-up bound, then idles without one: workers wait
    in it for rank 0's next command for as long as the server has no request."""
    from pagedserve import SamplingParams
    monkeypatch.setenv("PAGEDSERVE_TP_START_TIMEOUT", "8")
    llm = LLM(str(tiny_model_dir("llama")), **KW, tensor_parallel_size=2)
    try:
        # Past the bound and the store's / gloo's backstop (BACKSTOP_MARGIN_S), plus 1 s: the
        # workers' waits began before LLM() returned.
        time.sleep(8 + BACKSTOP_MARGIN_S + 1)
        sp = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
        out = llm.generate(["The quick brown fox"], sp, use_tqdm=False)
        assert len(out[0].outputs[0].token_ids) == 4
    finally:
        llm.shutdown()
    assert not launch_children(os.getpid())
