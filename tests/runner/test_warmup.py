"""The start-up warm-up (pagedserve.runner.warmup) leaves the engine exactly as it found it.

On CPU the warm-up runs only with PAGEDSERVE_WARMUP=1, which lets these tests build the same
engine with and without it and compare: the pools, the KV manager's counters, the global RNG
state and seeded / greedy / logprob outputs must all be identical.
"""
import pytest
import torch

from pagedserve import SamplingParams
from pagedserve.runner import warmup
from pagedserve.runner.model_runner import ModelRunner
from pagedserve.runner.request_state import DeviceRequestState
from pagedserve.runner.warmup import WARMUP_ENV, warmup_enabled

from engine.helpers import make_llm, prompt_ids

MAX_NEW = 12
ENGINE_KW = dict(block_size=8, num_gpu_blocks_override=48, max_num_seqs=8, max_num_batched_tokens=64,
                 enable_prefix_caching=True, seed=3)


def _params() -> list[SamplingParams]:
    return [
        SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=3),
        SamplingParams(temperature=0.9, seed=11, max_tokens=MAX_NEW, ignore_eos=True),
        SamplingParams(temperature=0.7, top_k=15, top_p=0.8, seed=5, max_tokens=MAX_NEW, ignore_eos=True),
        SamplingParams(temperature=1.0, max_tokens=MAX_NEW, ignore_eos=True),  # the engine's shared generator
        SamplingParams(temperature=0.8, repetition_penalty=1.3, presence_penalty=0.4, seed=2,
                       max_tokens=MAX_NEW, ignore_eos=True, logprobs=0),
    ]


def _build(monkeypatch, model_dir, warmup: bool, calls: list | None = None):
    monkeypatch.setenv(WARMUP_ENV, "1" if warmup else "0")
    if calls is not None:
        original = ModelRunner.execute_model

        def counting(self, step, prev_sampled=None):
            calls.append(step)
            return original(self, step, prev_sampled)
        monkeypatch.setattr(ModelRunner, "execute_model", counting)
    torch.manual_seed(0)
    llm = make_llm(model_dir, **ENGINE_KW)
    rng_after_start = torch.random.get_rng_state()
    monkeypatch.undo()
    return llm, rng_after_start


def _generate(llm, model_dir):
    prompts = prompt_ids(model_dir)
    params = _params()
    reqs = [{"prompt_token_ids": p} for p in prompts]
    outs = llm.generate(reqs, [params[i % len(params)] for i in range(len(reqs))], use_tqdm=False)
    return [(c.token_ids, c.cumulative_logprob, c.logprobs) for o in outs for c in o.outputs]


def test_warmup_env_modes(monkeypatch):
    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    monkeypatch.delenv(WARMUP_ENV, raising=False)
    assert (warmup_enabled(cpu), warmup_enabled(cuda)) == (False, True)
    monkeypatch.setenv(WARMUP_ENV, "1")
    assert warmup_enabled(cpu) and warmup_enabled(cuda)
    monkeypatch.setenv(WARMUP_ENV, "0")
    assert not warmup_enabled(cpu) and not warmup_enabled(cuda)
    monkeypatch.setenv(WARMUP_ENV, "yes")
    with pytest.raises(ValueError, match=WARMUP_ENV):
        warmup_enabled(cpu)


def test_warmup_leaves_engine_clean_and_outputs_identical(monkeypatch, tiny_model_dir):
    model_dir = tiny_model_dir("llama")
    calls: list = []
    warm, warm_rng = _build(monkeypatch, model_dir, warmup=True, calls=calls)
    cold, cold_rng = _build(monkeypatch, model_dir, warmup=False)

    runner = warm.llm_engine.runner
    # It really ran: prefills, chunks after context, decodes, a swap and a copy went through the runner.
    assert "warmup_seconds" in runner.profile and "warmup_seconds" not in cold.llm_engine.runner.profile
    batches = [s.batch for s in calls if s.batch is not None]
    assert any(b.num_decodes == 0 and b.starts.max() > 0 for b in batches)
    assert any(b.num_decodes == len(b.query_lens) for b in batches)
    assert any(b.query_lens.sum() == ENGINE_KW["max_num_batched_tokens"] for b in batches)

    # Exactly clean: pools zeroed as allocated, KV manager and its counters untouched, RNG restored.
    assert torch.count_nonzero(runner.cache_engine.gpu_pool) == 0
    assert warm.get_kv_cache_stats() == cold.get_kv_cache_stats()
    stats = warm.get_kv_cache_stats()
    assert stats.num_blocks_free == stats.num_blocks_total == ENGINE_KW["num_gpu_blocks_override"]
    assert (stats.num_blocks_cached, stats.peak_blocks_used, stats.num_swapped_blocks) == (0, 0, 0)
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits, stats.num_preemptions) == (0, 0, 0)
    assert torch.equal(warm_rng, cold_rng)
    assert torch.equal(warm.llm_engine.generator.get_state(), cold.llm_engine.generator.get_state())

    # Seeded, unseeded, greedy and logprob outputs are the same with and without the warm-up.
    assert _generate(warm, model_dir) == _generate(cold, model_dir)
    assert warm.get_kv_cache_stats() == cold.get_kv_cache_stats()


@pytest.mark.parametrize("block_size", [8, 1])
def test_warmup_prepares_the_incremental_inputs_on_a_state_of_its_own(monkeypatch, tiny_model_dir, block_size):
    """The warm-up's steps take the host-built input path; serving's take request_state.py's (its
    integer kernels load on first use on CUDA), so the warm-up runs that too: a prefill and a
    decode-only step, on a state of its own (the runner's stays unset), giving the slots,
    positions and lengths the host path gives for the same steps."""
    prepared = []
    original = DeviceRequestState.prepare

    def spy(self, rows, batch, block_size):
        prepared.append((self, batch, torch.is_inference_mode_enabled()))
        return original(self, rows, batch, block_size)
    monkeypatch.setattr(DeviceRequestState, "prepare", spy)
    monkeypatch.setenv(WARMUP_ENV, "1")
    llm = make_llm(tiny_model_dir("llama"), **{**ENGINE_KW, "block_size": block_size})
    runner = llm.llm_engine.runner
    # as the rest of the warm-up, under inference mode
    assert [(b.num_decodes, len(b.query_lens), inference) for _, b, inference in prepared] == [(0, 2, True), (2, 2, True)]
    assert prepared[0][0] is prepared[1][0] and runner.request_state is None
    steps = warmup._Steps(runner, runner.max_model_len)
    got = warmup._device_state_inputs(steps, torch.device("cpu"))
    for inp, (_, batch, _) in zip(got, prepared[2:]):
        want = batch.to_model_input(block_size, torch.device("cpu"))
        assert torch.equal(inp.attn_meta.slot_mapping, want.attn_meta.slot_mapping)
        assert torch.equal(inp.positions, want.positions)
        assert torch.equal(inp.attn_meta.seq_lens, want.attn_meta.seq_lens)
        assert torch.equal(inp.sample_indices, want.sample_indices)
    assert len(prepared) == 4


def test_warmup_fits_a_tiny_pool_and_short_context(monkeypatch, tiny_model_dir):
    """Block ids wrap around a pool smaller than one long sequence; lengths stay in max_model_len."""
    model_dir = tiny_model_dir("llama")
    monkeypatch.setenv(WARMUP_ENV, "1")
    llm = make_llm(model_dir, block_size=4, num_gpu_blocks_override=3, max_model_len=16, max_num_seqs=4,
                   max_num_batched_tokens=16, swap_space=0)
    assert torch.count_nonzero(llm.llm_engine.runner.cache_engine.gpu_pool) == 0
    assert llm.get_kv_cache_stats().num_blocks_free == 3
    out = llm.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(temperature=0.0, max_tokens=4),
                       use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4


@pytest.mark.parametrize("tokens", [0, 512, 300, 100, -1])
def test_split_variants_cover_every_compile(monkeypatch, tokens):
    """Every variant the decode kernels compile for is warmed up, whatever the split switch
    (-1: balanced): the warm-up's (decodes, context length) per compile key equals the
    brute-force set over every batch and length, and each really gives its key."""
    from types import SimpleNamespace

    from pagedserve.attention import decode_plan, triton_ops
    from pagedserve.runner import warmup

    monkeypatch.setattr(warmup, "get_backend", lambda device: triton_ops)
    monkeypatch.setattr(decode_plan, "decode_split_tokens", lambda: tokens)
    runner = SimpleNamespace(device=torch.device("cpu"), num_kv_heads=2)
    max_seqs, max_len = 12, 20000
    found = warmup._split_variants(runner, max_seqs, max_len)
    every = {decode_plan.decode_compile_key(n, 2, seq_len, runner.device)
             for n in range(1, max_seqs + 1) for seq_len in range(1, max_len + 1, 3)}
    assert set(found) == every and len(every) >= 5  # reduce blocks 1, 2, 4, 8, 16 at least
    assert {mode for _, mode in every} == ({0} if tokens == 0 else {0, tokens})
    for key, (n, seq_len) in found.items():
        assert 1 <= n <= max_seqs and 1 <= seq_len <= max_len
        assert decode_plan.decode_compile_key(n, 2, seq_len, runner.device) == key
