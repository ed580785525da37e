"""A steady decode step uploads only what changed: counted bytes, through DeviceRequestState's
upload record (last_upload: bytes per array of the step's one staging copy), not timing."""
from __future__ import annotations

import pytest

from pagedserve import SamplingParams
from pagedserve.runner.request_state import DeviceRequestState

from engine.helpers import assert_no_leak, make_llm, prompt_ids

BLOCK = 4


def _record(monkeypatch) -> list[dict]:
    steps: list[dict] = []
    original = DeviceRequestState.prepare

    def recording(state, rows, batch, block_size):
        inp = original(state, rows, batch, block_size)
        if batch is not None:
            steps.append(dict(upload=dict(state.last_upload), n=len(rows.rows),
                              decode_only=batch.num_decodes == len(rows.rows),
                              opens_block=int(sum(s > 0 and s % block_size == 0 for s in batch.starts.tolist())),
                              width=int(rows.table_lens.max())))
        return inp
    monkeypatch.setattr(DeviceRequestState, "prepare", recording)
    return steps


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_decode_steps_upload_rows_tokens_and_new_blocks_only(tiny_model_dir, monkeypatch, async_scheduling):
    model_dir = tiny_model_dir("llama")
    steps = _record(monkeypatch)
    llm = make_llm(model_dir, block_size=BLOCK, async_scheduling=async_scheduling)
    ids = prompt_ids(model_dir)
    # Same length for everyone (ignore_eos): no row is freed before the end, nothing is preempted.
    llm.generate([{"prompt_token_ids": p} for p in ids], SamplingParams(temperature=0.0, max_tokens=16,
                                                                        ignore_eos=True), use_tqdm=False)
    assert_no_leak(llm)
    decodes = [s for s in steps if s["decode_only"]]
    assert len(decodes) >= 10 and any(s["opens_block"] == 0 for s in decodes) and any(s["opens_block"] for s in decodes)
    per_seq = {"rows", "input_ids"} | ({"placeholder_dst", "placeholder_src"} if async_scheduling else set())
    for s in decodes:
        n, opened = s["n"], s["opens_block"]
        up = s["upload"]
        # Per sequence: its row and its token (8 bytes each; with overlap its placeholder's
        # destination and source too); per new block: row, column and block id (8 + 8 + 4).
        expect = {k: 8 * n for k in per_seq if k in up}
        assert set(up) - set(expect) <= {"entry_rows", "entry_cols", "entry_vals"}, up
        if not async_scheduling:
            assert set(expect) == per_seq  # (with overlap, a step right after a sync one has no placeholders)
        if opened:
            expect.update(entry_rows=8 * opened, entry_cols=8 * opened, entry_vals=4 * opened)
        assert up == expect
        # The stateless path uploads every table in full each step: 4 bytes per entry of width.
        assert sum(up.values()) < 4 * n * s["width"] + 8 * 3 * n
    steady = [s for s in decodes if not s["opens_block"]]
    assert steady and all(sum(s["upload"].values()) <= 32 * s["n"] for s in steady)


def test_a_freed_row_costs_its_index_and_a_new_table_its_entries(tiny_model_dir, monkeypatch):
    """Requests that finish at different steps: each finish sends one cleared row (8 bytes)."""
    model_dir = tiny_model_dir("llama")
    steps = _record(monkeypatch)
    llm = make_llm(model_dir, block_size=BLOCK, async_scheduling=False)
    ids = prompt_ids(model_dir)[:4]
    outs = llm.generate([{"prompt_token_ids": p} for p in ids],
                        [SamplingParams(temperature=0.0, max_tokens=3 + 2 * i, ignore_eos=True) for i in range(4)],
                        use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [3, 5, 7, 9]
    cleared = [s["upload"].get("cleared_rows", 0) for s in steps]
    assert sum(cleared) == 8 * 3  # three rows freed while others still ran (the last goes with the engine)
    first = steps[0]["upload"]
    assert first["entry_vals"] == 4 * sum(-(-len(p) // BLOCK) for p in ids)  # every prompt's table, once
