"""TP=2 (two processes, gloo, float32) generates exactly what TP=1 does, for every sharding case:
KV heads split across ranks (llama), one KV head replicated on both ranks with per-head q/k
norms (qwen3), qkv bias with tied embeddings (qwen2), q/k/v and gate/up fused in the checkpoint
and partial LongRoPE (phi3), Gemma 3's layers (a sliding window), OLMo 2's q/k norms over every
head (split and replicated KV heads), and OPT's biases, learned positions and
tied LM head, a mixture of experts with a shared expert (qwen2_moe); and under preemption by swapping (every rank moves its own heads' blocks)
with chunked prefill, with synchronous and with overlapped steps."""
import os

import pytest

from pagedserve import LLM
from tp_helpers import PROMPTS, STEP_MODES, assert_same_greedy, count_placeholder_steps, greedy, launch_children

CASES = {
    # arch, tiny_config overrides, KV heads each rank holds at TP=2
    "llama-split-kv": ("llama", {}, 1),
    "qwen3-replicated-kv": ("qwen3", {"num_key_value_heads": 1}, 1),
    "qwen2-qkv-bias-tied": ("qwen2", {}, 1),
    "phi3-fused-checkpoint": ("phi3", {}, 1),
    "phi3-fused-replicated-kv": ("phi3", {"num_key_value_heads": 1}, 1),
    "opt-biases": ("opt", {}, 2),
    # Gemma 3: four norms a layer, q/k norms, a sliding layer and a global one with their own RoPEs.
    "gemma3-windows": ("gemma3", {}, 1),
    "gemma2-soft-caps": ("gemma2", {}, 1),
    "granite-multipliers": ("granite", {}, 1),
    # OLMo 2: q/k norms over every head, their sums of squares all-reduced; with one KV head on
    # both ranks, k's squares are counted once.
    "olmo2-split-kv": ("olmo2", {}, 1),
    "olmo2-replicated-kv": ("olmo2", {"num_key_value_heads": 1}, 1),
    # Mixture of experts: every expert's intermediate dim split, the shared expert's partial summed
    # with the experts' before the layer's one all-reduce; layer 0 dense.
    "qwen2-moe-shared-expert": ("qwen2_moe", {}, 1),
}


@pytest.mark.parametrize("case", list(CASES))
def test_tp2_matches_tp1(tiny_model_dir, case):
    arch, overrides, kv_heads_per_rank = CASES[case]
    model = str(tiny_model_dir(arch, **overrides))
    kw = dict(device="cpu", num_gpu_blocks_override=64, block_size=8)
    tp1 = LLM(model, **kw)
    ref = greedy(tp1)
    llm = LLM(model, tensor_parallel_size=2, **kw)
    try:
        runner = llm.llm_engine.runner.runner  # rank 0's own ModelRunner
        assert (runner.tp_rank, runner.tp_size) == (0, 2)
        assert runner.num_kv_heads == kv_heads_per_rank
        assert_same_greedy(ref, greedy(llm))
        # A second batch on the same engine: blocks freed and reused across requests. The TP=1
        # reference runs its second batch on its own engine too, with the same history.
        assert_same_greedy(greedy(tp1, PROMPTS[::-1], 8), greedy(llm, PROMPTS[::-1], 8))
    finally:
        llm.shutdown()
    assert not launch_children(os.getpid())


def test_tp2_expert_parallel_matches_tp1(tiny_model_dir):
    """Whole experts per rank (Mixtral: 2 of 4 each), the pairs routed elsewhere dropped."""
    model = str(tiny_model_dir("mixtral"))
    kw = dict(device="cpu", num_gpu_blocks_override=64, block_size=8)
    ref = greedy(LLM(model, **kw))
    llm = LLM(model, tensor_parallel_size=2, enable_expert_parallel=True, **kw)
    try:
        experts = llm.llm_engine.runner.runner.model.model.layers[0].mlp.experts
        assert (experts.num_local_experts, experts.expert_start) == (2, 0)
        assert_same_greedy(ref, greedy(llm))
    finally:
        llm.shutdown()


def test_tp_size_that_does_not_split_the_heads_is_a_value_error(tiny_model_dir):
    with pytest.raises(ValueError, match=r"tensor_parallel_size \(3\) must divide num_attention_heads \(4\)"):
        LLM(str(tiny_model_dir("llama")), device="cpu", tensor_parallel_size=3)
    assert not launch_children(os.getpid())


@pytest.fixture(scope="class")
def preempting_engines(tiny_model_dir):
    """(TP=1 reference, TP=2 engine whose pool forces preemption), shared by the step modes in
    TestUnderPreemption: the TP=2 start-up is most of each test's time, and nothing carries from
    one mode's run to the next (no prefix caching on either; every block is free again after a
    run, checked below)."""
    model = str(tiny_model_dir("llama"))
    ref = LLM(model, device="cpu", num_gpu_blocks_override=256, block_size=4, enable_prefix_caching=False)
    # 24 blocks of 4 tokens cannot hold 4 sequences of 30-80 tokens; 8 tokens a step chunks every prompt.
    kw = dict(device="cpu", num_gpu_blocks_override=24, block_size=4, max_num_batched_tokens=8,
              max_model_len=96, preemption_mode="swap", enable_prefix_caching=False)
    llm = LLM(model, tensor_parallel_size=2, **kw)
    try:
        yield ref, llm
    finally:
        llm.shutdown()


class TestUnderPreemption:
    """Both step modes on one pair of engines, shut down when the class is done (before the next
    test, which counts leftover workers)."""

    @pytest.mark.parametrize("mode", list(STEP_MODES))
    def test_tp2_under_preemption_and_chunked_prefill(self, preempting_engines, mode):
        ref_llm, llm = preempting_engines
        prompts = PROMPTS
        logprobs = STEP_MODES[mode]
        ref = greedy(ref_llm, prompts, 24, logprobs)
        schedule = llm.llm_engine.scheduler.schedule
        preemptions_before = llm.get_kv_cache_stats().num_preemptions
        try:
            placeholder_steps = count_placeholder_steps(llm)
            assert_same_greedy(ref, greedy(llm, prompts, 24, logprobs))
            assert (placeholder_steps[0] > 0) == (mode == "overlap")
        finally:
            llm.llm_engine.scheduler.schedule = schedule  # the other mode counts its own steps
        stats = llm.get_kv_cache_stats()
        assert stats.num_preemptions > preemptions_before  # this run preempted, not only an earlier one
        assert stats.num_blocks_used == 0
