"""Unset batch limits follow the device as vLLM's do (config.batch_defaults); set ones are kept."""
import pytest

from pagedserve.config import EngineConfig, batch_defaults

GiB = 2**30


@pytest.mark.parametrize("memory, name, serving, expected", [
    (141 * GiB, "NVIDIA H200", False, (1024, 16384)),   # offline on a large GPU: vLLM's LLM-class defaults
    (141 * GiB, "NVIDIA H200", True, (1024, 8192)),     # behind the server: the shorter step
    (80 * GiB, "NVIDIA H100 80GB HBM3", False, (1024, 16384)),
    (80 * GiB, "NVIDIA A100-SXM4-80GB", False, (256, 8192)),  # vLLM keeps the A100 on the small defaults
    (24 * GiB, "NVIDIA L4", True, (256, 8192)),
    (0, "", False, (256, 8192)),                         # CPU
])
def test_batch_defaults_by_device(memory, name, serving, expected):
    assert batch_defaults(memory, name, serving) == expected


def test_set_limits_are_kept_and_unset_ones_filled():
    cfg = EngineConfig(model="m", max_num_seqs=8).with_batch_defaults(141 * GiB, "NVIDIA H200")
    assert (cfg.max_num_seqs, cfg.max_num_batched_tokens) == (8, 16384)
    cfg = EngineConfig(model="m", max_num_batched_tokens=512).with_batch_defaults(141 * GiB, "NVIDIA H200", True)
    assert (cfg.max_num_seqs, cfg.max_num_batched_tokens) == (1024, 512)
    sched = cfg.scheduler_config(max_model_len=256)
    assert (sched.max_num_seqs, sched.max_num_batched_tokens) == (1024, 512)


def test_without_chunked_prefill_the_budget_covers_max_model_len():
    cfg = EngineConfig(model="m", enable_chunked_prefill=False).with_batch_defaults(141 * GiB, "NVIDIA H200")
    assert cfg.max_num_batched_tokens is None
    assert cfg.scheduler_config(max_model_len=32768).max_num_batched_tokens == 32768
    assert cfg.scheduler_config(max_model_len=1024).max_num_batched_tokens == 8192


def test_engine_resolves_its_limits_on_cpu(tiny_model_dir):
    from pagedserve.entrypoints.llm import LLM
    llm = LLM(tiny_model_dir("llama"), device="cpu", num_gpu_blocks_override=32, block_size=8)
    engine = llm.llm_engine
    assert (engine.config.max_num_seqs, engine.config.max_num_batched_tokens) == (256, 8192)
    assert engine.scheduler_config.max_num_seqs == 256
    assert engine.scheduler_config.max_num_batched_tokens == 8192


def test_unset_limits_are_not_errors_and_bad_ones_are():
    assert EngineConfig(model="m").max_num_seqs is None
    with pytest.raises(ValueError, match="max_num_seqs"):
        EngineConfig(model="m", max_num_seqs=0)
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        EngineConfig(model="m", max_num_batched_tokens=0)


def test_priority_policy_runs_lower_priority_values_first(tiny_model_dir):
    """LLM.generate(priority=...) under scheduling_policy="priority" (vLLM's): one sequence at a
    time, so requests start in priority order, not submission order; tokens do not change.
    Under fcfs a priority other than 0 is refused naming the flag."""
    from pagedserve import SamplingParams

    from .helpers import make_llm, prompt_ids
    model_dir = tiny_model_dir("llama")
    prompts = [{"prompt_token_ids": p} for p in prompt_ids(model_dir)[:3]]
    sp = SamplingParams(temperature=0, max_tokens=4)
    llm = make_llm(model_dir, max_num_seqs=1, scheduling_policy="priority")
    outs = llm.generate(prompts, sp, use_tqdm=False, priority=[2, 0, 1])
    started = [o.metrics["first_scheduled_time"] for o in outs]
    assert sorted(range(3), key=started.__getitem__) == [1, 2, 0]
    fcfs = make_llm(model_dir, max_num_seqs=1)
    assert [o.outputs[0].token_ids for o in fcfs.generate(prompts, sp, use_tqdm=False)] == \
        [o.outputs[0].token_ids for o in outs]
    with pytest.raises(ValueError, match="priority \\(1\\) needs scheduling_policy 'priority'"):
        fcfs.generate(prompts[:1], sp, use_tqdm=False, priority=[1])
    with pytest.raises(ValueError, match="priority must be one per prompt"):
        llm.generate(prompts, sp, use_tqdm=False, priority=[0])
