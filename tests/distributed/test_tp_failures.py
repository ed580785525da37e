"""A tensor-parallel rank that dies fails the engine loudly, naming the rank and the cause, and
leaves no process behind; workers whose rank 0 dies exit on their own. Each failure mid-run is
tried with synchronous and with overlapped steps (a step in flight when the rank fails)."""
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from pagedserve import LLM
from pagedserve.runner.executor import TensorParallelError
from pagedserve.runner.tp_worker import FAIL_ENV
from tp_helpers import PROMPTS, STEP_MODES, count_placeholder_steps, greedy, launch_children, pid_alive

KW = dict(device="cpu", num_gpu_blocks_override=64, block_size=8, tensor_parallel_size=2)


def _assert_step_mode(placeholder_steps: list[int], mode: str) -> None:
    assert (placeholder_steps[0] > 0) == (mode == "overlap")


@pytest.mark.timeout(180)
@pytest.mark.parametrize("mode", list(STEP_MODES))
def test_killed_worker_fails_engine_naming_rank(tiny_model_dir, mode):
    logprobs = STEP_MODES[mode]
    llm = LLM(str(tiny_model_dir("llama")), **KW)
    try:
        placeholder_steps = count_placeholder_steps(llm)
        greedy(llm, PROMPTS[:1], 4, logprobs)
        _assert_step_mode(placeholder_steps, mode)
        pid = llm.llm_engine.runner.worker_pids[1]
        os.kill(pid, signal.SIGKILL)
        with pytest.raises(TensorParallelError, match=r"rank 1 .*SIGKILL"):
            greedy(llm, PROMPTS, 8, logprobs)
        # The engine stays failed, with the same diagnosis, instead of hanging on the next call.
        with pytest.raises(TensorParallelError, match="rank 1"):
            greedy(llm, PROMPTS[:1], 2, logprobs)
    finally:
        llm.shutdown()
    assert not pid_alive(pid)
    assert not launch_children(os.getpid())


@pytest.mark.timeout(180)
@pytest.mark.parametrize("mode", list(STEP_MODES))
def test_worker_exception_reports_rank_and_cause(tiny_model_dir, monkeypatch, mode):
    monkeypatch.setenv(FAIL_ENV, "1:3")  # rank 1 raises on its third step; the workers inherit the env
    llm = LLM(str(tiny_model_dir("llama")), **KW)
    try:
        placeholder_steps = count_placeholder_steps(llm)
        with pytest.raises(TensorParallelError, match=r"rank 1 failed: InjectedFailure: injected failure on rank 1"):
            greedy(llm, PROMPTS, 8, STEP_MODES[mode])
        # Overlapped: step 2 (the first with placeholders) was still in flight when rank 1 failed in step 3.
        _assert_step_mode(placeholder_steps, mode)
    finally:
        llm.shutdown()
    assert not launch_children(os.getpid())


DRIVER = """
import json, sys, time
from pagedserve import LLM
llm = LLM(sys.argv[1], device="cpu", num_gpu_blocks_override=64, tensor_parallel_size=2)
print(json.dumps(llm.llm_engine.runner.worker_pids), flush=True)
time.sleep(600)
"""


@pytest.mark.timeout(180)
def test_workers_exit_when_rank0_is_killed(tiny_model_dir):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    driver = subprocess.Popen([sys.executable, "-c", DRIVER, str(tiny_model_dir("llama"))], env=env,
                              stdout=subprocess.PIPE, text=True)
    try:
        pids = json.loads(driver.stdout.readline())
        worker = pids["1"]
        assert pid_alive(worker)
    finally:
        driver.kill()
        driver.wait()
    deadline = time.monotonic() + 60
    while pid_alive(worker) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not pid_alive(worker), "an orphaned tensor-parallel worker kept running"


@pytest.mark.timeout(180)
@pytest.mark.parametrize("mode", list(STEP_MODES))
def test_hung_worker_is_reported_after_the_collective_timeout(tiny_model_dir, monkeypatch, mode):
    monkeypatch.setenv(FAIL_ENV, "1:2:hang")  # rank 1 stops answering (alive, silent) on its second step
    # The per-collective bound applies only once the compute group exists (start-up's waits have
    # their own bound), when both ranks run in lockstep: 2 s is far above a tiny model's step (ms),
    # and this test waits it out (plus rank 0's 2 s for a report that never comes).
    monkeypatch.setenv("PAGEDSERVE_TP_TIMEOUT", "2")
    llm = LLM(str(tiny_model_dir("llama")), **KW)
    try:
        pid = llm.llm_engine.runner.worker_pids[1]
        placeholder_steps = count_placeholder_steps(llm)
        with pytest.raises(TensorParallelError, match=r"rank\(s\) \[1\] stopped answering in execute_model"):
            greedy(llm, PROMPTS, 8, STEP_MODES[mode])
        _assert_step_mode(placeholder_steps, mode)
    finally:
        llm.shutdown()
    assert not pid_alive(pid)
