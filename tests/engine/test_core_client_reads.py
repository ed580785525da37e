"""How the API server reads the core's messages (MPCoreClient.get_output_async) and how the core
sends utility answers: answers never wait behind token outputs queued before them, each
request's outputs keep their order, and a backlog lets the event loop turn.

The client runs over its real sockets against a puppet core (it sends Ready and otherwise only
waits for Shutdown); the test pushes the core's messages itself, so what is queued when is exact.
"""
from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

import pytest
import zmq

from pagedserve.config import EngineConfig
from pagedserve.engine import core_client
from pagedserve.engine.async_engine import AsyncLLMEngine
from pagedserve.engine.core_client import MPCoreClient
from pagedserve.engine.core_messages import (Codec, CompletionDelta, RequestDelta, StepOutputs,
                                             StepOutputsHead, UtilityResult)
from pagedserve.sampling_params import RequestOutputKind, SamplingParams

from engine.helpers import puppet_core

PUPPET = puppet_core()
CODEC = Codec()
DELTA = SamplingParams(max_tokens=8, output_kind=RequestOutputKind.DELTA)


@pytest.fixture
def client(monkeypatch):
    root = str(Path(__file__).resolve().parents[2])
    monkeypatch.setenv("PYTHONPATH", root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    c = MPCoreClient(EngineConfig(), ready_timeout_s=60, core_cmd=[sys.executable, "-c", PUPPET])
    push = c._ctx.socket(zmq.PUSH)
    push.connect(f"ipc://{c._dir}/outputs")  # the test speaks for the core
    yield c, push
    push.close(linger=0)
    c.shutdown()


def tokens(*pairs: tuple[str, int], reply: UtilityResult | None = None) -> bytes:
    outs = [RequestDelta(rid, [CompletionDelta(0, "", [tok], None, None)], False) for rid, tok in pairs]
    return CODEC.encode(StepOutputs(outputs=outs, utility_results=[reply] if reply else []))


def read_ahead(c: MPCoreClient, n: int) -> None:
    """Read (as get_output_async does first) until n messages are in, so what is queued is exact."""
    while len(c._read_ahead) < n:
        c._output.poll(5000)
        c._read_waiting()


async def added(c: MPCoreClient, push, rids: str) -> None:
    adds = [asyncio.ensure_future(c.add_request_async(r, [1], DELTA, 0.0)) for r in rids]
    await asyncio.sleep(0)
    push.send(CODEC.encode(StepOutputs(added=list(rids))))
    assert (await c.get_output_async()).outputs == []
    await asyncio.gather(*adds)


def test_the_head_reads_a_step_message_field_for_field():
    assert StepOutputsHead.__struct_fields__ == StepOutputs.__struct_fields__
    msg = StepOutputs(outputs=[RequestDelta("r", [CompletionDelta(0, "x", [5], -0.5, None)], True, {"t": 1.0})],
                      added=["r"], rejected=[("q", "bad")], utility_results=[UtilityResult(3, {"a": [1]})],
                      failed=["z"], step_error="boom")
    head = CODEC.step_head.decode(CODEC.encode(msg))
    assert CODEC.step_outputs.decode(head.outputs) == msg.outputs
    assert [getattr(head, f) for f in StepOutputs.__struct_fields__[1:]] == \
        [getattr(msg, f) for f in StepOutputs.__struct_fields__[1:]]


def test_a_reply_queued_behind_token_outputs_is_answered_before_any_of_them(client):
    c, push = client

    async def main():
        await added(c, push, "ab")
        reply = asyncio.ensure_future(c.call_utility_async("get_kv_cache_state"))
        await asyncio.sleep(0)
        assert not c._read_ahead
        push.send(tokens(("a", 1), ("b", 1)))
        push.send(tokens(("b", 2), ("a", 2), reply=UtilityResult(0, {"version": 7})))
        push.send(tokens(("a", 3), ("b", 3)))
        read_ahead(c, 3)
        assert c._utility[0].result() == {"version": 7}  # answered; no output handed out yet
        seen = {"a": [], "b": []}
        for _ in range(3):
            for o in (await c.get_output_async()).outputs:
                seen[o.request_id] += o.outputs[0].token_ids
        assert seen == {"a": [1, 2, 3], "b": [1, 2, 3]}  # each request's order as the core sent it
        assert await reply == {"version": 7}
    asyncio.run(main())


def test_the_reply_in_a_message_is_resolved_before_its_outputs_reach_the_streams(client):
    c, push = client

    async def main():
        engine = AsyncLLMEngine(c, None)
        engine.start()
        streams = await asyncio.gather(*(engine.add_request(r, [1], DELTA) for r in "ab"), answer(c, push))
        reply = asyncio.ensure_future(engine.get_kv_cache_state())
        await asyncio.sleep(0)
        seen_done = []
        for st in engine._requests.values():
            put = st.queue.put_nowait
            st.queue.put_nowait = lambda item, put=put: (seen_done.append(c._utility[0].done()), put(item))
        push.send(tokens(*[(r, t) for t in range(1, 6) for r in "ab"], reply=UtilityResult(0, {"v": 1})))
        assert await reply == {"v": 1}
        # The five outputs each stream got while nobody read leave as one (RequestStream merges).
        got = [(await s.__anext__()).outputs[0].token_ids for s in streams[:2]]
        assert seen_done == [True] * 10 and got == [[1, 2, 3, 4, 5]] * 2
        await engine.shutdown()

    async def answer(c, push):
        while len(c._adds) < 2:
            await asyncio.sleep(0.001)
        push.send(CODEC.encode(StepOutputs(added=["a", "b"])))
    asyncio.run(main())


@pytest.mark.parametrize("slice_s, turns", [(0.0, True), (3600.0, False)])
def test_a_backlog_lets_the_loop_turn_every_slice(client, monkeypatch, slice_s, turns):
    """Messages read ahead are handed out without suspending (batching keeps the server's CPU
    per token low) until DISPATCH_SLICE_S has passed since the loop last turned."""
    c, push = client
    monkeypatch.setattr(core_client, "DISPATCH_SLICE_S", slice_s)

    async def main():
        await added(c, push, "a")
        for t in range(3):
            push.send(tokens(("a", t)))
        read_ahead(c, 3)
        ran = []
        asyncio.get_running_loop().call_soon(ran.append, 1)
        await c.get_output_async()
        await c.get_output_async()
        return bool(ran)
    assert asyncio.run(main()) is turns


class CoreSockets:
    """The core's two sockets: input messages handed out in turn (then Shutdown, once the core
    would block for more), every output message kept."""

    class Frame:
        def __init__(self, data: bytes) -> None:
            self.buffer = data

    def __init__(self, inputs: list) -> None:
        from pagedserve.engine.core_messages import CoreInputs, Shutdown
        self.inputs = [CODEC.encode(m) for m in inputs] + [CODEC.encode(CoreInputs([Shutdown()]))]
        self.sent: list[StepOutputs] = []

    def recv(self, flags: int = 0, copy: bool = True):
        if flags and len(self.inputs) <= 1:  # a non-blocking read finds nothing until it would block
            raise zmq.Again()
        return self.Frame(self.inputs.pop(0))

    def send(self, data: bytes, copy: bool = True) -> None:
        self.sent.append(CODEC.step.decode(data))


def test_the_core_sends_a_utility_answer_before_running_the_step():
    from pagedserve.benchmark.modelless_core import ModelLessEngine
    from pagedserve.engine.core import EngineCore
    from pagedserve.engine.core_messages import AddRequest, CoreInputs, UtilityCall
    sockets = CoreSockets([CoreInputs([AddRequest("r", [1, 2, 3], DELTA, 0.0),
                                       UtilityCall(0, "get_kv_cache_stats", [False])])])
    core = EngineCore(None, engine=ModelLessEngine(num_blocks=16, max_num_seqs=4, step_s=0.0))
    core.run_busy_loop(sockets, sockets)
    first, second = sockets.sent[0], sockets.sent[1]
    assert [r.call_id for r in first.utility_results] == [0] and first.outputs == [] and first.added == []
    assert second.utility_results == [] and second.added == ["r"]
    assert [o.request_id for o in second.outputs] == ["r"]
    assert sum(len(o.outputs[0].token_ids) for m in sockets.sent for o in m.outputs) == DELTA.max_tokens



def test_a_request_sent_to_a_core_already_dead_fails_with_503_and_blocks_nothing(monkeypatch):
    """SIGKILL the core, then add a request before the watch has seen the death (the loop is kept
    from turning until ZMQ has dropped the core's end). The PUSH has no peer then, and a blocking
    send froze the event loop, the watch with it, and every caller of the server for good. Run in
    a process of its own: the hang can only be seen from outside (an alarm inside is swallowed by
    the event loop that runs the send)."""
    root = str(Path(__file__).resolve().parents[2])
    monkeypatch.setenv("PYTHONPATH", root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    scenario = f"""
import asyncio, os, signal, sys, time
import zmq
from pagedserve.config import EngineConfig
from pagedserve.engine.async_engine import AsyncLLMEngine, EngineDeadError
from pagedserve.engine.core_client import MPCoreClient
from pagedserve.sampling_params import SamplingParams
c = MPCoreClient(EngineConfig(), ready_timeout_s=60, core_cmd=[sys.executable, "-c", {PUPPET!r}])

async def main():
    engine = AsyncLLMEngine(c, None)
    engine.start()
    os.kill(c.pid, signal.SIGKILL)
    c.proc.wait()
    while c._input.poll(0, zmq.POLLOUT):  # ZMQ still holds the core's end: not yet peerless
        time.sleep(0.01)
    assert engine.errored is None  # the watch has not turned since
    try:
        await engine.add_request("late", [1], SamplingParams(max_tokens=2))
    except EngineDeadError as e:
        assert engine.num_unfinished_requests == 0 and not c._ops  # nothing left to send
        print("status", e.status, e)
asyncio.run(main())
c.shutdown()
"""
    try:
        done = subprocess.run([sys.executable, "-c", scenario], capture_output=True, text=True, timeout=60)
    except subprocess.TimeoutExpired:
        pytest.fail("adding a request to a dead core hung its event loop (no answer in 60 s)")
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.startswith("status 503 engine core is dead") and "SIGKILL" in done.stdout, done.stdout


def test_the_modelless_core_starts_and_streams_through_the_real_client():
    """benchmarks/dashboard/dashboard_latency.py's core process: start-up (its ready line) and a
    request to the end over MPCoreClient (the start-up line once named a model it did not have)."""
    import asyncio
    import sys

    from pagedserve.config import EngineConfig
    from pagedserve.engine.core_client import MPCoreClient
    from pagedserve.sampling_params import SamplingParams
    core = [sys.executable, "-m", "pagedserve.benchmark.modelless_core", "--step-ms", "1", "--num-blocks", "64"]
    client = MPCoreClient(EngineConfig(), core_cmd=core)
    try:
        async def run() -> list[int]:
            async def read() -> list[int]:
                while True:  # also what resolves the add: its answer comes with the outputs
                    for o in (await client.get_output_async()).outputs:
                        if o.finished:
                            return list(o.outputs[0].token_ids)
            reader = asyncio.ensure_future(read())
            await client.add_request_async("r", [5, 6, 7], SamplingParams(max_tokens=4, ignore_eos=True), 0.0, None)
            return await reader
        assert asyncio.run(asyncio.wait_for(run(), 60)) == [100, 101, 102, 103]
    finally:
        client.shutdown()


async def held_dispatch(c: MPCoreClient, push, tokenizer, params: dict) -> tuple:
    """An AsyncLLMEngine over the puppet core with these requests (id -> SamplingParams) added and
    its output dispatch stopped, so a backlog pushed next is exact; each request's deliveries land
    in puts[id] instead of its stream. Returns (engine, streams: kept, a dropped one aborts, puts)."""
    engine = AsyncLLMEngine(c, tokenizer)
    engine.start()

    async def answer():
        while len(c._adds) < len(params):
            await asyncio.sleep(0.001)
        push.send(CODEC.encode(StepOutputs(added=list(params))))
    *streams, _ = await asyncio.gather(*(engine.add_request(r, [1], p) for r, p in params.items()), answer())
    engine._tasks[0].cancel()
    await asyncio.gather(engine._tasks[0], return_exceptions=True)
    puts = {r: [] for r in params}
    for rid, st in engine._requests.items():
        st.queue.put_nowait = lambda item, rid=rid: puts[rid].append(item)
    return engine, streams, puts


def test_a_backlog_of_steps_reaches_each_stream_as_one_output_and_a_failure_after_it(client):
    """Steps that queued while the server was busy (AsyncLLMEngine._catch_up): each request's
    tokens of all of them are processed and delivered once, in order; a message that fails a
    request is not joined ahead of the outputs before it; a request whose core outputs are not
    deltas (CUMULATIVE, no tokenizer here) keeps every output."""
    c, push = client
    cumulative = SamplingParams(max_tokens=8, output_kind=RequestOutputKind.CUMULATIVE)

    async def main():
        engine, streams, puts = await held_dispatch(c, push, None, {"a": DELTA, "b": DELTA, "c": cumulative})
        for t in (1, 2, 3):
            push.send(tokens(("a", t), ("b", t)))
        push.send(CODEC.encode(StepOutputs(outputs=[
            RequestDelta("c", [CompletionDelta(0, "", [7], None, None)], False)])))
        push.send(CODEC.encode(StepOutputs(outputs=[
            RequestDelta("c", [CompletionDelta(0, "", [7, 8], None, None)], False)])))
        push.send(CODEC.encode(StepOutputs(outputs=[
            RequestDelta("a", [CompletionDelta(0, "", [4], None, None)], False)], failed=["b"], step_error="boom")))
        read_ahead(c, 6)
        task = asyncio.ensure_future(engine._dispatch_outputs())
        while len(puts["b"]) < 2:
            await asyncio.sleep(0.001)
        task.cancel()
        assert [o.outputs[0].token_ids for o in puts["a"]] == [[1, 2, 3], [4]]
        assert [o.outputs[0].token_ids for o in puts["b"][:1]] == [[1, 2, 3]]
        assert isinstance(puts["b"][1], core_client.EngineDeadError) and "boom" in str(puts["b"][1])
        assert [o.outputs[0].token_ids for o in puts["c"]] == [[7], [7, 8]]
        for s in streams:
            s.close()
    asyncio.run(main())


def test_a_backlog_keeps_the_steps_of_a_request_with_stop_strings_apart(client, tiny_model_dir):
    """With a tokenizer, a request's queued steps are joined before its text, except where stop
    strings cut it: there every step is processed alone, so a cut leaves the cumulative logprob
    of the kept tokens (not of the run-on tokens a joined chunk would end with)."""
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(str(tiny_model_dir("llama")))
    c, push = client
    stops = SamplingParams(max_tokens=8, output_kind=RequestOutputKind.DELTA, stop=["zzzq"])

    async def main():
        engine, streams, puts = await held_dispatch(c, push, tok, {"p": DELTA, "s": stops})
        for t in (40, 41, 42):
            push.send(CODEC.encode(StepOutputs(outputs=[
                RequestDelta(r, [CompletionDelta(0, "", [t], -1.0 * (t - 39), None)], False) for r in "ps"])))
        read_ahead(c, 3)
        task = asyncio.ensure_future(engine._dispatch_outputs())
        while not puts["p"]:  # the three steps are dispatched in one turn of the loop: all in by then
            await asyncio.sleep(0.001)
        task.cancel()
        assert [o.outputs[0].token_ids for o in puts["p"]] == [[40, 41, 42]]
        assert [(o.outputs[0].token_ids, o.outputs[0].cumulative_logprob) for o in puts["s"]] == \
            [([40], -1.0), ([41], -2.0), ([42], -3.0)]
        for s in streams:
            s.close()
    asyncio.run(main())
