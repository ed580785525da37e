"""The engine-core message codec: msgspec round trips of the batched messages, field for field."""
from __future__ import annotations

import math

import msgspec
import pytest

from pagedserve.engine.core_messages import (AbortRequests, AddBeamSearch, AddRequest, Codec, CompletionDelta,
                                             CoreInputs, Ready, RequestDelta, Shutdown,
                                             StartupFailed, StepOutputs, UtilityCall, UtilityResult)
from pagedserve.logprobs import PositionLogprobs
from pagedserve.metrics import EngineSnapshot
from pagedserve.outputs import CompletionOutput
from pagedserve.sampling_params import (BeamSearchParams, RequestOutputKind, SamplingParams,
                                         StructuredOutputsParams)


def test_batched_inputs_round_trip_in_order():
    codec = Codec()
    params = SamplingParams(n=2, temperature=0.7, top_p=0.9, top_k=5, seed=2**62, max_tokens=9,
                            min_tokens=2, stop=["\n\n", "Ω"], stop_token_ids=[3, 4], logprobs=3,
                            output_kind=RequestOutputKind.DELTA, skip_special_tokens=False)
    msg = CoreInputs([AddRequest("a", [1, 2, 3], params, 1.25, "héllo"),
                      AbortRequests(["a", "b"]),
                      AddRequest("b", [7], SamplingParams(), 2.5),
                      UtilityCall(4, "get_kv_cache_stats", [False]),
                      Shutdown()])
    back = codec.inputs.decode(codec.encode(msg))
    assert back == msg
    assert [type(op) for op in back.ops] == [AddRequest, AbortRequests, AddRequest, UtilityCall, Shutdown]
    assert back.ops[0].params == params and back.ops[0].params.output_kind is RequestOutputKind.DELTA


def test_beam_search_add_round_trips_beside_sampling_adds():
    codec = Codec()
    beam = BeamSearchParams(beam_width=4, max_tokens=7, ignore_eos=True, temperature=0.5, length_penalty=-0.5,
                            structured_outputs=StructuredOutputsParams(choice=["yes", "no"]))
    msg = CoreInputs([AddBeamSearch("b", [5, 6], beam, 3.5, "hi", "salt", -2),
                      AddRequest("a", [7], SamplingParams(), 2.5)])
    back = codec.inputs.decode(codec.encode(msg))
    assert back == msg and [type(op) for op in back.ops] == [AddBeamSearch, AddRequest]
    assert back.ops[0].params.structured_outputs == StructuredOutputsParams(choice=["yes", "no"])


def test_step_message_round_trip():
    codec = Codec()
    c = CompletionOutput(index=1, text="ab", token_ids=[5, 6], cumulative_logprob=-1.5,
                         logprobs=[PositionLogprobs([5, 9], [-0.5, -math.inf], 1), PositionLogprobs([6], [-1.0], 3)],
                         finish_reason="stop", stop_reason=6)
    msg = StepOutputs(
        outputs=[RequestDelta("r1", [CompletionDelta.of(c)], True, {"arrival_time": 1.0, "first_token_time": 2.0}),
                 RequestDelta("r2", [CompletionDelta(0, "", [8], None, None)], False)],
        added=["r2"], rejected=[("r3", "prompt must not be empty")],
        utility_results=[UtilityResult(1, {"num_blocks_used": 3}), UtilityResult(2, error="boom")],
        snapshot=EngineSnapshot(num_running=2, num_waiting=1, kv_cache_usage=0.25, num_preemptions=4),
        failed=["r9"], step_error="engine step failed: RuntimeError()")
    back = codec.step.decode(codec.encode(msg))
    assert back == msg
    assert back.outputs[0].outputs[0].to_output() == c
    assert back.outputs[0].outputs[0].logprobs[0] == PositionLogprobs([5, 9], [-0.5, -math.inf], 1)


def test_handshake_and_malformed_input():
    codec = Codec()
    ready = Ready(pid=1, max_model_len=512, vocab_size=1000, num_gpu_blocks=64, num_cpu_blocks=0,
                  block_size=16, max_num_seqs=8, eos_token_ids=[2])
    assert codec.handshake.decode(codec.encode(ready)) == ready
    assert codec.handshake.decode(codec.encode(StartupFailed("ValueError: x"))) == StartupFailed("ValueError: x")
    bad = msgspec.msgpack.encode([[["add", "r", "not ids", {}, 0.0]]])
    with pytest.raises(msgspec.ValidationError):
        codec.inputs.decode(bad)
