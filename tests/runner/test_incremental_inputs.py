"""The persistent device state (runner/request_state.py) equals a full rebuild after every step.

Every executed step of a real engine run is checked three ways against the stateless path
(HostBatch.to_model_input, which rebuilds and uploads every table):
  - the step's ModelInput (ids, positions, slots, block tables, lengths, sample rows) is equal;
  - every live device table of the KV manager equals its row of the persistent block table,
    zeros after it, and every unused row is all zeros;
  - each scheduled row's computed count is where the step left its sequence.
The runs cover preemption by recompute and by swap, prefix hits, chunked prefill, aborts,
n > 1 forks with copy-on-write, beam search and the contiguous allocator, with overlapped steps
on and off.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from pagedserve import SamplingParams
from pagedserve.attention import gathered_prefill_plan
from pagedserve.runner.batch import host_batch
from pagedserve.runner.row_tracker import INCREMENTAL_ENV
from pagedserve.runner.request_state import DeviceRequestState

from engine.helpers import add_fork_beam_mix, assert_no_leak, fork_is_forked, make_llm, prompt_ids


class StateChecker:
    """Wraps one engine's runner: compares every incremental step with a full rebuild."""

    def __init__(self, llm, monkeypatch):
        self.engine = llm.llm_engine
        self.runner = self.engine.runner.runner
        self.mgr = self.engine.scheduler.kv_cache_manager
        self.steps = self.decode_steps = self.page_runs_seen = 0
        self._full = None
        runner, prepare, execute = self.runner, self.runner.prepare_inputs, self.runner.execute_model

        def prepare_and_rebuild(out):
            # The stateless batch of the same plan, with copies of the tables as they are now.
            full = host_batch(out.scheduled, out.num_decodes) if out.scheduled else None
            if full is not None:
                full.block_tables = [list(t) for t in full.block_tables]
            self._full = (full, [(s.seq.seq_id, s.start + s.num_new_tokens) for s in out.scheduled])
            step = prepare(out)
            assert step.rows is not None, "the engine's steps must take the incremental path"
            return step

        def execute_and_check(step, prev_sampled=None):
            result = execute(step, prev_sampled)
            self._check_state()
            return result
        monkeypatch.setattr(runner, "prepare_inputs", prepare_and_rebuild)
        monkeypatch.setattr(runner, "execute_model", execute_and_check)
        original = DeviceRequestState.prepare

        def prepare_state(state, rows, batch, block_size):
            inp = original(state, rows, batch, block_size)
            if inp is not None:
                self._check_input(inp, block_size)
            return inp
        monkeypatch.setattr(DeviceRequestState, "prepare", prepare_state)

    def _check_input(self, inp, block_size: int) -> None:
        full, _ = self._full
        ref = full.to_model_input(block_size, self.runner.device)
        self.steps += 1
        self.decode_steps += full.num_decodes == len(full.starts)
        for name in ("input_ids", "positions", "sample_indices", "placeholder_dst", "placeholder_src"):
            a, b = getattr(inp, name), getattr(ref, name)
            assert (a is None) == (b is None), name
            if a is not None:
                assert torch.equal(a, b), name
        assert inp.num_sampling == ref.num_sampling
        m, r = inp.attn_meta, ref.attn_meta
        for name in ("slot_mapping", "query_start_loc", "seq_lens", "block_tables"):
            a, b = getattr(m, name), getattr(r, name)
            assert a.dtype == b.dtype and torch.equal(a, b), name
        for name in ("num_decodes", "max_query_len", "max_seq_len", "block_size", "query_lens_cpu", "seq_lens_cpu",
                     "page_runs"):
            assert getattr(m, name) == getattr(r, name), name
        self.page_runs_seen += bool(m.page_runs)

    def _check_state(self) -> None:
        state, tracker = self.runner.request_state, self.runner.row_tracker
        if state is None:
            return
        table, computed = state.block_table.cpu().numpy(), state.computed.cpu().numpy()
        live = {sid: self.mgr.table_ids(sid) for sid in self._live_ids()}
        assert set(tracker.row_of) == set(live)
        used = np.zeros(table.shape[0], dtype=bool)
        for sid, ids in live.items():
            row = tracker.row_of[sid]
            used[row] = True
            assert table[row, :len(ids)].tolist() == ids
            assert not table[row, len(ids):].any()
        assert not table[~used].any()
        for sid, end in self._full[1]:
            if sid in tracker.row_of:
                assert computed[tracker.row_of[sid]] == end
                assert tracker.computed[tracker.row_of[sid]] == end

    def _live_ids(self):
        mgr = self.mgr
        return list(mgr._block_ids) if hasattr(mgr, "_block_ids") else list(mgr._runs)


def _generate(llm, checker, prompts, params):
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert checker.steps > 0 and checker.decode_steps > 0
    assert_no_leak(llm)
    return outs


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir):
    return tiny_model_dir("llama")


@pytest.mark.parametrize("async_scheduling", [True, False])
@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_state_under_preemption(model_dir, monkeypatch, mode, async_scheduling):
    llm = make_llm(model_dir, block_size=8, num_gpu_blocks_override=16, preemption_mode=mode, swap_space=0.05,
                   max_num_batched_tokens=64, async_scheduling=async_scheduling)
    checker = StateChecker(llm, monkeypatch)
    ids = prompt_ids(model_dir)
    _generate(llm, checker, [{"prompt_token_ids": p} for p in ids],
              SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True))
    stats = llm.get_kv_cache_stats()
    assert stats.num_preemptions > 0
    assert (llm.llm_engine.scheduler.num_swap_outs > 0) == (mode == "swap")


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_state_with_prefix_hits_and_chunked_prefill(model_dir, monkeypatch, async_scheduling):
    """Also AttentionMetadata.page_runs (chunks of 4+ tokens here, whose pages a fresh pool lays in
    one run) from the host's tables, alike on both paths."""
    monkeypatch.setattr(gathered_prefill_plan, "MIN_CHUNK", 4)
    llm = make_llm(model_dir, block_size=4, max_num_batched_tokens=7, async_scheduling=async_scheduling)
    checker = StateChecker(llm, monkeypatch)
    ids = prompt_ids(model_dir)
    params = SamplingParams(temperature=0.0, max_tokens=9, ignore_eos=True)
    _generate(llm, checker, [{"prompt_token_ids": p} for p in ids], params)
    _generate(llm, checker, [{"prompt_token_ids": p} for p in ids[:4]], params)  # hits the cached prompts
    assert llm.get_kv_cache_stats().prefix_cache_hits > 0
    assert checker.page_runs_seen > 0


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_state_with_forks_beams_swaps_and_aborts(model_dir, monkeypatch, async_scheduling):
    llm = make_llm(model_dir, block_size=4, num_gpu_blocks_override=48, swap_space=0.05, preemption_mode="swap",
                   async_scheduling=async_scheduling)
    checker = StateChecker(llm, monkeypatch)
    engine = llm.llm_engine
    ids = prompt_ids(model_dir)
    add_fork_beam_mix(engine, ids, max_tokens=40, fork_seed=2)
    saw_swapped = saw_forked = False
    for step in range(200):
        engine.step()
        saw_swapped |= engine.scheduler.num_swapped > 0
        saw_forked |= fork_is_forked(engine)
        if step == 25:
            engine.abort_request(["r1", "r4"])
        if not engine.has_unfinished_requests():
            break
    assert saw_forked and saw_swapped and checker.steps > 25
    assert_no_leak(llm)


def test_state_with_contiguous_allocator(model_dir, monkeypatch):
    llm = make_llm(model_dir, block_size=8, kv_allocator="contiguous-pow2", num_gpu_blocks_override=40)
    checker = StateChecker(llm, monkeypatch)
    ids = prompt_ids(model_dir)
    _generate(llm, checker, [{"prompt_token_ids": p} for p in ids],
              SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("async_scheduling", [True, False])
@pytest.mark.parametrize("enforce_eager", [True, False])
def test_state_on_cuda_with_graphs(model_dir, monkeypatch, async_scheduling, enforce_eager):
    """The same exact-state checks on the GPU: decode graphs and piecewise graphs read the per-step
    gathers, overlapped steps fill placeholders on the device, and swaps run on pinned memory."""
    monkeypatch.setenv(INCREMENTAL_ENV, "1")  # off by default on CUDA until this test has passed there
    llm = make_llm(model_dir, device="cuda", block_size=8, num_gpu_blocks_override=24, preemption_mode="swap",
                   swap_space=0.05, max_num_batched_tokens=64, max_num_seqs=16, enforce_eager=enforce_eager,
                   async_scheduling=async_scheduling)
    if not enforce_eager:
        assert llm.llm_engine.runner.graphs is not None
    checker = StateChecker(llm, monkeypatch)
    ids = prompt_ids(model_dir)
    _generate(llm, checker, [{"prompt_token_ids": p} for p in ids],
              SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True))
    assert llm.get_kv_cache_stats().num_preemptions > 0


def test_a_fresh_scheduler_starts_fresh_rows(model_dir, monkeypatch):
    """LLMEngine.use_scheduler (benchmarks swap policies on one engine): the runner forgets the old
    rows and the new scheduler's log starts with the runner, so steps stay exact."""
    from pagedserve.core.scheduler import Scheduler
    llm = make_llm(model_dir, block_size=8)
    engine = llm.llm_engine
    ids = [{"prompt_token_ids": p} for p in prompt_ids(model_dir)[:4]]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    first = [o.outputs[0].token_ids for o in llm.generate(ids, params, use_tqdm=False)]
    engine.use_scheduler(Scheduler(engine.scheduler_config, engine.cache_config))
    assert engine.runner.request_state is None and engine.scheduler.kv_cache_manager.table_log is not None
    checker = StateChecker(llm, monkeypatch)
    assert [o.outputs[0].token_ids for o in _generate(llm, checker, ids, params)] == first
