"""EngineCore's loop iteration in-process: ordered ops, utility calls, a failed step."""
from __future__ import annotations

import pytest

from pagedserve.engine.core import EngineCore
from pagedserve.engine.core_client import InprocCoreClient
from pagedserve.engine.core_messages import (AbortRequests, AddRequest, Codec, CoreInputs, StepOutputs,
                                             UtilityCall)
from pagedserve.sampling_params import RequestOutputKind, SamplingParams

from .helpers import make_llm

DELTA = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True, output_kind=RequestOutputKind.DELTA)


def _iteration(core: EngineCore, *ops) -> StepOutputs:
    """One loop iteration as the process runs it, through the codec both ways."""
    codec = Codec()
    out = StepOutputs()
    assert core.handle_inputs(codec.inputs.decode(codec.encode(CoreInputs(list(ops)))), out)
    if core.has_unfinished_requests():
        core.step_outputs(out)
    out.snapshot = core.snapshot()
    return codec.step.decode(codec.encode(out))


def test_ops_apply_in_order_and_tokens_match_llm(tiny_model_dir):
    llm = make_llm(tiny_model_dir("llama"))
    core = EngineCore(None, engine=llm.llm_engine)
    want = llm.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(temperature=0.0, max_tokens=5,
                                                                          ignore_eos=True), use_tqdm=False)
    # add, abort, add again under the same id, in one message: the second add is the one that runs.
    out = _iteration(core, AddRequest("a", [9, 9, 9], DELTA, 0.0), AbortRequests(["a"]),
                     AddRequest("a", [5, 6, 7], DELTA, 0.0), AddRequest("b", [10**6], DELTA, 0.0))
    assert out.added == ["a", "a"]
    assert [r[0] for r in out.rejected] == ["b"] and "prompt_token_ids" in out.rejected[0][1]
    tokens = [t for o in out.outputs for c in o.outputs for t in c.token_ids]
    while not (out.outputs and out.outputs[-1].finished):
        out = _iteration(core)
        tokens += [t for o in out.outputs for c in o.outputs for t in c.token_ids]
    assert tokens == want[0].outputs[0].token_ids
    assert out.snapshot.num_running == 0 and out.snapshot.kv_cache_usage == 0

    stats = _iteration(core, UtilityCall(1, "get_kv_cache_stats", [False]),
                       UtilityCall(2, "shutdown", []))
    assert stats.utility_results[0].result["num_blocks_used"] == 0
    assert stats.utility_results[0].result["num_live_tokens"] is None
    assert "must be an engine-core utility" in stats.utility_results[1].error


def test_failed_step_fails_its_requests_and_the_core_lives_on(tiny_model_dir, monkeypatch):
    llm = make_llm(tiny_model_dir("llama"))
    core = EngineCore(None, engine=llm.llm_engine)
    _iteration(core, AddRequest("x", [1, 2, 3], DELTA, 0.0), AddRequest("y", [4, 5], DELTA, 0.0))
    runner = llm.llm_engine.runner
    real = runner.execute

    def broken(*a, **k):
        raise RuntimeError("device fell off")
    monkeypatch.setattr(runner, "execute", broken)
    out = _iteration(core)
    assert out.failed == ["x", "y"] and "device fell off" in out.step_error
    assert out.snapshot.kv_cache_usage == 0 and not core.has_unfinished_requests()
    monkeypatch.setattr(runner, "execute", real)
    out = _iteration(core, AddRequest("z", [1, 2, 3], DELTA, 0.0))
    assert out.added == ["z"]
    # With overlapped steps a step returns the tokens of the step launched before it: z's first
    # token arrives one iteration later.
    outputs = out.outputs or _iteration(core).outputs
    assert outputs[0].request_id == "z" and outputs[0].outputs[0].token_ids


def test_inproc_client_raises_the_steps_own_error(tiny_model_dir, monkeypatch):
    llm = make_llm(tiny_model_dir("llama"))
    client: InprocCoreClient = llm.engine_core
    client.add_request("r", [1, 2, 3], SamplingParams(max_tokens=3))

    def broken(*a, **k):
        raise KeyError("boom")
    monkeypatch.setattr(llm.llm_engine.runner, "execute", broken)
    with pytest.raises(KeyError, match="boom"):
        client.get_output()
    assert not client.has_unfinished_requests()
    assert client.call_utility("get_kv_cache_stats")["num_blocks_used"] == 0
