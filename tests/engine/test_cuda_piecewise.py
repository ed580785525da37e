"""Piecewise CUDA graphs on the GPU (skipped without CUDA): steps with prefill tokens replay
graph pieces with eager attention between them, or, when their prefill is short, the decode graph
of their token count with one decode row per token (runner/decode_rows.py). float32: the
engine's greedy tokens equal the eager engine's on a mixed, chunked workload, either way;
bfloat16: each mixed step's logits agree with the same runner's eager forward within the
tolerance of the other bf16 CUDA tests."""
import random

import pytest
import torch

from pagedserve import SamplingParams
from pagedserve.config import EngineConfig
from pagedserve.core.plan import SchedulerOutput
from pagedserve.models.loader import load_hf_config
from pagedserve.runner import model_runner
from pagedserve.runner.decode_rows import SHORT_PREFILL_ENV
from pagedserve.runner.model_runner import ModelRunner
from paged_harness import HandDriver
from .helpers import assert_no_leak, make_llm

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def count_piecewise_runs(runner) -> list[int]:
    """Token counts of the steps that took the piecewise path, appended as they run."""
    used: list[int] = []
    run = runner.piecewise.run
    runner.piecewise.run = lambda ids, pos, meta: (used.append(ids.shape[0]), run(ids, pos, meta))[1]
    return used


def count_decode_row_steps(monkeypatch) -> list[int]:
    """Token counts of the steps sent to a decode graph as decode rows, appended as they run."""
    used: list[int] = []
    rewrite = model_runner.as_decode_rows

    def counted(meta, positions):
        rows = rewrite(meta, positions)
        if rows is not None:
            used.append(rows.num_seqs)
        return rows
    monkeypatch.setattr(model_runner, "as_decode_rows", counted)
    return used


def mixed_requests(vocab: int, n: int = 24) -> tuple[list[list[int]], list[SamplingParams]]:
    rng = random.Random(0)
    prompts = [[rng.randrange(3, vocab) for _ in range(rng.randrange(3, 200))] for _ in range(n)]
    params = [SamplingParams(temperature=0.0, max_tokens=rng.randrange(4, 40), ignore_eos=True) for _ in range(n)]
    return prompts, params


@pytest.mark.parametrize("short_prefill_graphs", ["0", "1"])
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_float32_piecewise_tokens_equal_eager(tiny_model_dir, arch, short_prefill_graphs, monkeypatch):
    monkeypatch.setenv(SHORT_PREFILL_ENV, short_prefill_graphs)
    model_dir = tiny_model_dir(arch)
    # A small token budget and few sequences: prompts are chunked and join while others decode.
    # For decode rows every step must fit a decode graph (at most max_num_seqs tokens).
    kw = dict(device="cuda", dtype="float32", max_num_seqs=8, max_num_batched_tokens=256)
    if short_prefill_graphs == "1":
        kw.update(max_num_seqs=32, max_num_batched_tokens=32)
    eager = make_llm(model_dir, enforce_eager=True, **kw)
    prompts, params = mixed_requests(eager.llm_engine.runner.vocab_size)
    want = [o.outputs[0].token_ids for o in eager.generate([{"prompt_token_ids": p} for p in prompts], params,
                                                            use_tqdm=False)]
    del eager
    llm = make_llm(model_dir, cudagraph_mode="piecewise", **kw)
    runner = llm.llm_engine.runner
    assert runner.piecewise is not None and runner.graphs is not None
    assert runner.piecewise.buckets[-1] == kw["max_num_batched_tokens"]
    used = count_piecewise_runs(runner)
    rows = count_decode_row_steps(monkeypatch)
    got = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                                                         use_tqdm=False)]
    assert got == want
    if short_prefill_graphs == "1":
        assert len(rows) > 5 and not used  # every step with prefill replayed a decode graph
    else:
        assert not rows and len(used) > 5 and any(u not in runner.piecewise.buckets for u in used)  # padded
    assert_no_leak(llm)


def test_decode_mode_captures_no_pieces(tiny_model_dir):
    llm = make_llm(tiny_model_dir("llama"), device="cuda", cudagraph_mode="decode", max_num_seqs=8)
    assert llm.llm_engine.runner.graphs is not None and llm.llm_engine.runner.piecewise is None


@pytest.mark.parametrize("short_prefill_graphs", [False, True])
def test_bf16_mixed_steps_close_to_eager(tiny_model_dir, short_prefill_graphs, monkeypatch):
    model_dir = tiny_model_dir("llama")
    cfg = EngineConfig(model=str(model_dir), block_size=16, swap_space=0.01, max_num_batched_tokens=512)
    runner = ModelRunner(cfg, load_hf_config(model_dir), torch.device("cuda"), torch.bfloat16)
    runner.load_model()
    runner.init_kv_cache(128, 4)
    pw = runner.piecewise
    assert pw is not None
    runner.short_prefill_graphs = short_prefill_graphs
    used = count_piecewise_runs(runner)
    rows = count_decode_row_steps(monkeypatch)
    d = HandDriver(runner, seed=0)
    rng = random.Random(1)
    seqs = [d.add([rng.randrange(3, runner.vocab_size) for _ in range(n)]) for n in (5, 37, 90, 13, 200)]

    def check(sched):
        """The step eagerly (graphs off), then the same step with graphs; both write the same slots."""
        runner.piecewise, graphs, runner.graphs = None, runner.graphs, None
        ref = runner.execute(SchedulerOutput(scheduled=sched))
        runner.piecewise, runner.graphs = pw, graphs
        got = d.step(sched)
        err = (got - ref).abs().max() / ref.abs().max()
        assert err < 0.05, err
        assert (got.argmax(-1) == ref.argmax(-1)).float().mean() >= 2 / 3

    check([d.schedule(s) for s in seqs[:2]])                                          # 42 prompt tokens
    check([d.schedule(s, 1) for s in seqs[:2]] + [d.schedule(seqs[2])])               # 2 decodes + 90
    check([d.schedule(s, 1) for s in seqs[:3]] + [d.schedule(seqs[3]), d.schedule(seqs[4], 120)])
    check([d.schedule(s, 1) for s in seqs[:4]] + [d.schedule(seqs[4])])               # the chunk's rest
    # With short prefills as decode rows only the step of 133 prefill tokens (> 128) takes the pieces.
    assert (used, rows) == (([136], [42, 92, 84]) if short_prefill_graphs else ([42, 92, 136, 84], []))
