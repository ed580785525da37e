"""The server's engine (core in its own process, text in the API process) gives exactly the
outputs of the one-process LLMEngine: same tokens, text, finish and stop reasons, logprobs and
output shapes, step by step — with stop strings (cut in the API process, the core aborted),
EOS / stop_token_ids, min_tokens, n > 1 and best_of > n (seeded, so batch-independent).
Step by step up to catching up: outputs that queued while a consumer was busy leave as one
(DELTA joined, CUMULATIVE superseded), so each served output must be a run of the reference's
outputs merged, and the runs must cover them all, in order.
"""
from __future__ import annotations

import asyncio
import dataclasses

import pytest

from pagedserve.config import EngineConfig
from pagedserve.engine.async_engine import AsyncLLMEngine
from pagedserve.outputs import CompletionOutput, RequestOutput, merge_deltas
from pagedserve.sampling_params import RequestOutputKind, SamplingParams

from .helpers import PROMPT_TEXTS, make_llm, tokenizer

KINDS = [RequestOutputKind.DELTA, RequestOutputKind.CUMULATIVE, RequestOutputKind.FINAL_ONLY]
ENGINE = dict(device="cpu", dtype="float32", swap_space=0.01, num_gpu_blocks_override=512,
              block_size=8, enable_prefix_caching=False)


def _cases(greedy_texts: list[str], greedy_ids: list[list[int]]) -> list[tuple[int, SamplingParams]]:
    """(prompt index, params): stop strings taken from the greedy text so they are met."""
    def mid(text: str, n: int = 3) -> str:
        i = len(text) // 2
        return text[i:i + n] if text[i:i + n].strip() else text[1:1 + n]

    return [
        (0, SamplingParams(temperature=0.0, max_tokens=24, stop=[mid(greedy_texts[0])], logprobs=2)),
        (1, SamplingParams(temperature=0.0, max_tokens=24, stop=[mid(greedy_texts[1]), "zzzq"],
                           include_stop_str_in_output=True)),
        (2, SamplingParams(temperature=0.0, max_tokens=20, min_tokens=12, stop=[greedy_texts[2][:2]])),
        (3, SamplingParams(temperature=0.0, max_tokens=20, stop_token_ids=[greedy_ids[3][5]])),
        (4, SamplingParams(temperature=0.0, max_tokens=20, stop_token_ids=[greedy_ids[4][4]],
                           include_stop_str_in_output=True)),
        (5, SamplingParams(temperature=0.9, seed=11, n=3, max_tokens=16, stop=["e", "a"], logprobs=1)),
        (6, SamplingParams(temperature=1.0, seed=5, max_tokens=18, stop=["o"], skip_special_tokens=False)),
        (7, SamplingParams(temperature=0.0, max_tokens=16)),
        (8, SamplingParams(temperature=1.0, seed=3, max_tokens=12, ignore_eos=True)),
    ]


def _best_of_case(kind) -> list[tuple[int, SamplingParams]]:
    if kind is RequestOutputKind.DELTA:  # best_of > n cannot stream
        return []
    return [(6, SamplingParams(temperature=1.0, seed=9, n=2, best_of=4, max_tokens=14, stop=["i"],
                               output_kind=kind))]


def _shape(outs) -> list:
    """Every field but the timing metrics."""
    return [(o.request_id, o.prompt_token_ids, o.finished,
             [dataclasses.astuple(c) for c in o.outputs]) for o in outs]


def _same(a, b) -> bool:
    """Equal, with floats (logprobs) to 1e-5 relative: stopped sequences run on in the core, and
    a float32 matmul's last bits depend on the batch it is in."""
    if isinstance(a, float) and isinstance(b, float):
        return a == b or abs(a - b) <= 1e-5 * max(abs(a), abs(b))
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return a == b


def _caught_up(got: list, want: list, kind: RequestOutputKind) -> bool:
    """`got` is `want` with runs of successive outputs merged as a stream that fell behind merges
    them (RequestStream, AsyncLLMEngine._catch_up), every output of `want` in exactly one run."""
    j = 0
    for g in got:
        acc = None
        while j < len(want):
            w = want[j]
            j += 1
            # DELTA outputs join; a CUMULATIVE one supersedes (_shape leaves out the prompt's logprobs).
            acc = merge_deltas(acc, w) if acc is not None and kind is RequestOutputKind.DELTA else w
            if _same(_shape([acc]), _shape([g])):
                break
        else:
            return False
    return j == len(want)


def _reference(model_dir, requests) -> dict[str, list]:
    engine = make_llm(model_dir, **ENGINE).llm_engine
    for rid, ids, params in requests:
        engine.add_request(rid, {"prompt_token_ids": ids}, params)
    seen: dict[str, list] = {rid: [] for rid, _, _ in requests}
    while engine.has_unfinished_requests():
        for out in engine.step():
            seen[out.request_id].append(out)
    return seen


async def _served(engine: AsyncLLMEngine, requests) -> dict[str, list]:
    async def one(rid, ids, params, lag):
        outs = []
        async for o in engine.generate({"prompt_token_ids": ids}, params, rid):
            outs.append(o)
            await asyncio.sleep(lag)  # a consumer that falls behind: its outputs queue and merge
        return rid, outs

    try:
        return dict(await asyncio.gather(*(one(*r, 0.02 * (i % 2)) for i, r in enumerate(requests))))
    finally:
        await engine.shutdown()


def test_two_process_outputs_equal_the_one_process_engine(tiny_model_dir):
    model_dir = tiny_model_dir("llama")
    tok = tokenizer(str(model_dir))
    prompts = [tok.encode(t) for t in PROMPT_TEXTS]
    greedy = make_llm(model_dir).generate([{"prompt_token_ids": p} for p in prompts],
                                          SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True),
                                          use_tqdm=False)
    cases = _cases([g.outputs[0].text for g in greedy], [g.outputs[0].token_ids for g in greedy])
    requests = []
    for kind in KINDS:
        for j, (i, params) in enumerate(cases + _best_of_case(kind)):
            requests.append((f"{kind.value}-{j}", prompts[i], dataclasses.replace(params, output_kind=kind)))
    want = _reference(model_dir, requests)
    engine = AsyncLLMEngine.from_engine_config(EngineConfig(model=str(model_dir), **ENGINE))
    got = asyncio.run(_served(engine, requests))
    # The stop strings were met (the test means something), somewhere in every shape.
    finals = [outs[-1] for outs in want.values()]
    assert any(c.finish_reason == "stop" and isinstance(c.stop_reason, str) for f in finals for c in f.outputs)
    assert any(c.finish_reason == "stop" and isinstance(c.stop_reason, int) for f in finals for c in f.outputs)
    kinds = {rid: params.output_kind for rid, _, params in requests}
    for rid in want:
        assert _caught_up(got[rid], want[rid], kinds[rid]), (rid, _shape(got[rid]), _shape(want[rid]))


def test_caught_up_accepts_merged_runs_and_nothing_else():
    def out(text, ids, finished=False):
        return RequestOutput("r", None, [1], [CompletionOutput(0, text, ids, -1.0 * len(ids), None,
                                                               "length" if finished else None)], finished)
    want = [out("a", [1]), out("b", [2]), out("c", [3], True)]
    delta = RequestOutputKind.DELTA
    assert _caught_up(want, want, delta)
    assert _caught_up([merge_deltas(want[0], want[1]), want[2]], want, delta)
    assert not _caught_up([want[0], want[2]], want, delta)            # an output lost
    assert not _caught_up([want[0], want[1]], want, delta)            # the end missing
    assert not _caught_up([merge_deltas(want[1], want[0]), want[2]], want, delta)  # out of order
    cum = [out("a", [1]), out("ab", [1, 2]), out("abc", [1, 2, 3], True)]
    assert _caught_up([cum[0], cum[2]], cum, RequestOutputKind.CUMULATIVE)
    assert not _caught_up([cum[1], cum[0], cum[2]], cum, RequestOutputKind.CUMULATIVE)


def test_core_rejections_are_the_engines_value_errors(tiny_model_dir):
    model_dir = tiny_model_dir("llama")
    engine = AsyncLLMEngine.from_engine_config(EngineConfig(model=str(model_dir), **ENGINE))

    async def go():
        try:
            for bad in ([10**7], [], list(range(600))):
                with pytest.raises(ValueError, match="prompt"):
                    await engine.add_request("bad", {"prompt_token_ids": bad}, SamplingParams(max_tokens=4))
            # The core lives on: a good request right after is served, and stats come back.
            outs = [o async for o in engine.generate([1, 2, 3], SamplingParams(temperature=0, max_tokens=3), "ok")]
            assert outs[-1].finished and len(outs[-1].outputs[0].token_ids) == 3
            stats = await engine.get_kv_cache_stats()
            assert stats["num_blocks_used"] == 0 and stats["num_blocks_total"] == 512
        finally:
            await engine.shutdown()
    asyncio.run(go())
