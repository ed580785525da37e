"""Tensor-parallel start-up on CPU takes the GPU's path: every rank profiles (the same forward,
so the same collectives), the ranks agree on the KV block count, the scheduler receives the
measured costs, and a rank stuck in a start-up phase or a step fails the engine within the
configured bound, naming the rank and the phase, instead of hanging."""
import os

import pytest

from pagedserve import LLM
from pagedserve.runner.executor import TensorParallelError
from pagedserve.runner.model_runner import GiB, PROFILE_ON_CPU_ENV
from pagedserve.runner.tp_worker import FAIL_ENV
from tp_helpers import (PROMPTS, STEP_MODES, assert_same_greedy, count_placeholder_steps, greedy, launch_children,
                        pid_alive)

# A small profile batch keeps the CPU forward quick; a small pool keeps the block count readable.
KW = dict(device="cpu", block_size=8, max_num_batched_tokens=64, max_num_seqs=8, cpu_kv_cache_gib=1 / 1024,
          swap_space=1 / 1024)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("override", [None, 40])
def test_tp2_profiles_agrees_on_blocks_and_feeds_measured_costs(tiny_model_dir, monkeypatch, override):
    monkeypatch.setenv(PROFILE_ON_CPU_ENV, "1")
    model = str(tiny_model_dir("llama"))
    ref = LLM(model, **KW, num_gpu_blocks_override=override)
    try:
        measured = ref.llm_engine.runner.runner.profile
        ref_sched = ref.llm_engine.scheduler.scheduler_config
        assert (ref_sched.recompute_seconds_per_token, ref_sched.swap_seconds_per_block) == (
            measured["recompute_seconds_per_token"], measured["swap_seconds_per_block"])
        want = greedy(ref, PROMPTS, 8)
    finally:
        ref.shutdown()
    llm = LLM(model, **KW, num_gpu_blocks_override=override, tensor_parallel_size=2)
    try:
        engine = llm.llm_engine
        runner = engine.runner.runner  # rank 0's own ModelRunner
        # KV sizing: the profile ran (it timed the forward) and the pool holds what cpu_kv_cache_gib allows
        # for this rank's share of the KV heads, unless overridden.
        assert runner.profile["recompute_seconds_per_token"] > 0
        blocks = override or int(KW["cpu_kv_cache_gib"] * GiB // runner.block_bytes)
        assert engine.cache_config.num_gpu_blocks == blocks
        assert runner.cache_engine.num_gpu_blocks == blocks
        assert engine.cache_config.num_cpu_blocks == int(KW["swap_space"] * GiB // runner.block_bytes)
        # preemption_mode="auto" weighs the measured costs, not SchedulerConfig's constants.
        sched = engine.scheduler.scheduler_config
        assert sched.recompute_seconds_per_token == runner.profile["recompute_seconds_per_token"]
        assert sched.swap_seconds_per_block == runner.profile["swap_seconds_per_block"] > 0
        # Every rank allocated the agreed pool: generation is TP=1's.
        assert_same_greedy(want, greedy(llm, PROMPTS, 8))
    finally:
        llm.shutdown()


@pytest.mark.timeout(180)
@pytest.mark.parametrize("phase", ["determine_num_blocks", "capture_decode_graphs"])
def test_rank_stuck_in_a_startup_phase_fails_naming_rank_and_phase(tiny_model_dir, monkeypatch, phase):
    monkeypatch.setenv(PROFILE_ON_CPU_ENV, "1")
    monkeypatch.setenv(FAIL_ENV, f"1:{phase}:hang")  # rank 1 stops answering (alive, silent) there
    # The phases' own bound, which this test waits out, is short: a tiny model's phase takes
    # milliseconds. Before them (init_runner included) the start-up bound leaves rank 1 room to
    # import torch on a loaded machine (1.5-3 s on 2 idle cores).
    monkeypatch.setenv("PAGEDSERVE_TP_PHASE_TIMEOUT", "3")
    monkeypatch.setenv("PAGEDSERVE_TP_START_TIMEOUT", "8")
    stuck = rf"start-up phase {phase} did not finish within 3 s .*rank\(s\) \[1\] in {phase}"
    with pytest.raises(TensorParallelError, match=stuck):
        LLM(str(tiny_model_dir("llama")), **KW, tensor_parallel_size=2)
    assert not launch_children(os.getpid())


@pytest.mark.timeout(180)
@pytest.mark.parametrize("mode", list(STEP_MODES))
def test_rank_stuck_in_a_step_fails_naming_rank_within_the_step_timeout(tiny_model_dir, monkeypatch, mode):
    monkeypatch.setenv(FAIL_ENV, "1:2:hang")  # rank 1 stops answering on its second step
    # Steps only (start-up has its own bounds): a tiny model's step takes milliseconds, and this
    # test waits the bound out, so it is short.
    monkeypatch.setenv("PAGEDSERVE_TP_STEP_TIMEOUT", "2")
    llm = LLM(str(tiny_model_dir("llama")), **KW, num_gpu_blocks_override=64, tensor_parallel_size=2)
    try:
        pid = llm.llm_engine.runner.worker_pids[1]
        placeholder_steps = count_placeholder_steps(llm)
        with pytest.raises(TensorParallelError, match=r"step \(execute_model #\d+\) did not finish .*rank\(s\) \[1\]"):
            greedy(llm, PROMPTS, 8, STEP_MODES[mode])
        # Overlapped: rank 1 hung in step 2, the first one planned around placeholders.
        assert (placeholder_steps[0] > 0) == (mode == "overlap")
    finally:
        llm.shutdown()
    assert not pid_alive(pid)
