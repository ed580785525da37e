"""A request's outputs that queue up while its consumer is busy leave as one (RequestStream), and
nothing of them is lost: DELTA outputs are joined (outputs.merge_deltas), CUMULATIVE ones
superseded, an error after them still raised."""
import asyncio

from pagedserve.engine.request_stream import RequestStream, _RequestState
from pagedserve.outputs import CompletionOutput, RequestOutput, merge_deltas
from pagedserve.sampling_params import RequestOutputKind


def out(outputs, finished=False, prompt_logprobs=None, metrics=None):
    return RequestOutput("r", "p", [1, 2], outputs, finished, metrics, None, prompt_logprobs)


def co(index, text, ids, lps=None, cum=None, finish=None, stop=None):
    return CompletionOutput(index, text, ids, cum, lps, finish, stop)


def test_merge_deltas_joins_each_choice_in_order_and_keeps_the_later_state():
    a = out([co(0, "Hel", [5], [{5: -0.1}], -0.1), co(1, "A", [9], [{9: -0.5}], -0.5)],
            prompt_logprobs=[None, {2: -1.0}], metrics={"step": 1})
    b = out([co(1, "B", [8], [{8: -0.2}], -0.7, "stop", 2), co(0, "lo", [6, 7], [{6: -0.3}, {7: -0.4}], -0.8),
             co(2, "x", [3], None, None)], finished=False, metrics={"step": 2})
    m = merge_deltas(a, b)
    assert m.outputs == [co(0, "Hello", [5, 6, 7], [{5: -0.1}, {6: -0.3}, {7: -0.4}], -0.8),
                         co(1, "AB", [9, 8], [{9: -0.5}, {8: -0.2}], -0.7, "stop", 2),
                         co(2, "x", [3], None, None)]
    assert m.prompt_logprobs == [None, {2: -1.0}] and m.metrics == {"step": 2} and not m.finished
    assert merge_deltas(out([co(0, "a", [1])]), out([co(0, "b", [2])], finished=True)).finished
    # without logprobs on either side there are none after
    assert merge_deltas(out([co(0, "a", [1])]), out([co(0, "b", [2])])).outputs[0].logprobs is None


class _Engine:
    def __init__(self):
        self.released = []

    def _release(self, rid, st):
        self.released.append(rid)


def stream(kind, items):
    st = _RequestState(queue=asyncio.Queue(), arrival=0.0, kind=kind)
    for i in items:
        st.queue.put_nowait(i)
    return RequestStream(_Engine(), "r", st), st


def collect(s):
    async def run():
        got = []
        try:
            async for o in s:
                got.append(o)
        except ValueError as e:
            got.append(e)
        return got
    return asyncio.run(run())


def test_deltas_queued_behind_a_busy_consumer_leave_as_one():
    s, _ = stream(RequestOutputKind.DELTA, [out([co(0, "a", [1])]), out([co(0, "b", [2])]),
                                            out([co(0, "c", [3], finish="length")], finished=True)])
    got = collect(s)
    assert len(got) == 1 and got[0].finished
    assert (got[0].outputs[0].text, got[0].outputs[0].token_ids, got[0].outputs[0].finish_reason) == \
        ("abc", [1, 2, 3], "length")


def test_an_error_behind_queued_outputs_comes_after_them():
    err = ValueError("engine failed")
    s, _ = stream(RequestOutputKind.DELTA, [out([co(0, "a", [1])]), out([co(0, "b", [2])]), err])
    got = collect(s)
    assert [g.outputs[0].token_ids for g in got[:1]] == [[1, 2]] and got[1] is err and len(got) == 2


def test_cumulative_outputs_are_superseded_and_the_prompt_logprobs_kept():
    s, _ = stream(RequestOutputKind.CUMULATIVE, [out([co(0, "a", [1])], prompt_logprobs=[None]),
                                                 out([co(0, "ab", [1, 2])])])

    async def first():
        return await s.__anext__()
    o = asyncio.run(first())
    assert o.outputs[0].token_ids == [1, 2] and o.prompt_logprobs == [None]


def test_a_consumer_that_keeps_up_gets_every_output_on_its_own():
    st = _RequestState(queue=asyncio.Queue(), arrival=0.0, kind=RequestOutputKind.DELTA)
    s = RequestStream(_Engine(), "r", st)

    async def run():
        got = []
        for i in range(3):
            st.queue.put_nowait(out([co(0, str(i), [i])], finished=i == 2))
            got.append(await s.__anext__())
        return got
    assert [g.outputs[0].token_ids for g in asyncio.run(run())] == [[0], [1], [2]]


def test_final_only_outputs_are_never_merged():
    s, _ = stream(RequestOutputKind.FINAL_ONLY, [out([co(0, "a", [1])]), out([co(0, "ab", [1, 2])], finished=True)])
    assert [g.outputs[0].token_ids for g in collect(s)] == [[1], [1, 2]]
