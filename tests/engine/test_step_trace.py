"""StepTrace (PAGEDSERVE_STEP_TRACE): one JSON line per launched step with its shape and device
times, written only for finished steps, no gap after an idle engine; and the summary's grouping
(benchmarks/serving/step_trace_summary.py). On CPU the CUDA events are replaced by a clock whose
readings the test sets; on CUDA a real engine's trace must hold one line per step it ran."""
import importlib.util
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from pagedserve import SamplingParams
from pagedserve.engine.step_trace import StepTrace
from pagedserve.runner.model_runner import GRAPH_PATHS

from .helpers import make_llm, prompt_ids

spec = importlib.util.spec_from_file_location(
    "step_trace_summary", Path(__file__).resolve().parents[2] / "benchmarks/serving/step_trace_summary.py")
summary = importlib.util.module_from_spec(spec)
spec.loader.exec_module(summary)


class FakeEvent:
    """A CUDA event stand-in: recorded at the test clock's reading; done once the clock passes it."""

    def __init__(self, clock):
        self.clock, self.t = clock, clock["now"]

    def query(self):
        return self.clock["done"] >= self.t

    def elapsed_time(self, other):  # milliseconds, as torch.cuda.Event
        return other.t - self.t


def plan(decodes: int, prefill_tokens: int = 0):
    """decodes at contexts 100, 101, ...; a prefill chunk's context is its tokens."""
    sched = [SimpleNamespace(num_new_tokens=1, context_len=100 + i) for i in range(decodes)]
    if prefill_tokens:
        sched = sched + [SimpleNamespace(num_new_tokens=prefill_tokens, context_len=prefill_tokens)]
    return SimpleNamespace(scheduled=sched, num_decodes=decodes, num_batched_tokens=decodes + prefill_tokens)


def test_trace_lines_hold_shape_busy_and_gap(tmp_path, monkeypatch):
    clock = {"now": 0.0, "done": -1.0}
    trace = StepTrace(str(tmp_path / "t.jsonl"))
    monkeypatch.setattr(trace, "_event", lambda: FakeEvent(clock))

    def step(p, start, end):
        trace.begin()
        clock["now"] = start
        trace.launch_begin(p)
        clock["now"] = end
        trace.launch_end()

    step(plan(4), 0.0, 5.0)
    step(plan(4, 300), 5.5, 15.0)
    step(plan(8), 15.0, 21.0)
    clock["done"] = 15.0  # the device has finished the first two steps only
    assert trace.flush() == 2
    clock["done"] = 100.0
    assert trace.flush(idle=True) == 1
    step(plan(2), 200.0, 204.0)  # after an idle engine: no gap
    clock["done"] = 300.0
    assert trace.flush(idle=True) == 1
    lines = [json.loads(x) for x in (tmp_path / "t.jsonl").read_text().splitlines()]
    stamps = [x.pop("t") for x in lines]
    assert stamps == sorted(stamps) and stamps[0] > 1.7e9  # wall-clock launch times
    assert lines == [
        {"seqs": 4, "decodes": 4, "tokens": 4, "context": 406, "busy_ms": 5.0, "gap_ms": None},
        {"seqs": 5, "decodes": 4, "tokens": 304, "context": 706, "busy_ms": 9.5, "gap_ms": 0.5},
        {"seqs": 8, "decodes": 8, "tokens": 8, "context": 828, "busy_ms": 6.0, "gap_ms": 0.0},
        {"seqs": 2, "decodes": 2, "tokens": 2, "context": 201, "busy_ms": 4.0, "gap_ms": None},
    ]
    assert trace.records == [{}]  # phases are not kept


def test_under_load_finished_steps_become_lines_as_they_finish(tmp_path, monkeypatch):
    """10,000 steps with no idle moment, the device one step behind the host (async scheduling):
    every launch_end converts the step or two the device has finished, so nothing piles up for one
    long conversion (4096 steps at once stalled the engine core 60-102 ms on the H200), and the
    file grows by WRITE_EVERY lines at a time."""
    from pagedserve.engine.step_trace import WRITE_EVERY
    clock = {"now": 0.0, "done": -1.0}
    trace = StepTrace(str(tmp_path / "t.jsonl"))
    monkeypatch.setattr(trace, "_event", lambda: FakeEvent(clock))
    path, most_pending, sizes = tmp_path / "t.jsonl", 0, set()
    for i in range(10_000):
        trace.begin()
        clock["now"] = 5.0 * i
        trace.launch_begin(plan(8))
        clock["now"] = 5.0 * i + 4.9
        clock["done"] = 5.0 * i - 0.1  # the step before this one has finished on the device
        trace.launch_end()
        most_pending = max(most_pending, len(trace._events))
        if i % 50 == 0:  # (every size the file goes through lasts 512 steps)
            sizes.add(len(path.read_text().splitlines()) if path.exists() else 0)
    assert most_pending <= 2
    assert sizes == {WRITE_EVERY * k for k in range(10_000 // WRITE_EVERY + 1)}
    clock["done"] = 1e9
    assert trace.flush(idle=True) == 10_000 % WRITE_EVERY
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    assert len(lines) == 10_000 and all(x["busy_ms"] == 4.9 for x in lines)
    assert lines[0]["gap_ms"] is None and all(x["gap_ms"] == 0.1 for x in lines[1:])


def test_trace_lines_say_how_the_runner_ran_each_step(tmp_path, monkeypatch):
    clock = {"now": 0.0, "done": -1.0}
    trace = StepTrace(str(tmp_path / "t.jsonl"))
    monkeypatch.setattr(trace, "_event", lambda: FakeEvent(clock))
    runner = SimpleNamespace(last_graph_path=None)
    trace.graph_path_of = lambda: runner.last_graph_path
    for i, (p, path) in enumerate([(plan(4), "decode_graph"), (plan(2, 20), "decode_rows"),
                                   (plan(2, 500), "piecewise")]):
        trace.begin()
        clock["now"] = 10.0 * i
        trace.launch_begin(p)
        runner.last_graph_path = path  # the runner ran the step's forward
        clock["now"] = 10.0 * i + 5
        trace.launch_end()
        runner.last_graph_path = "eager"
        trace.launch_end()  # a second call for the same step changes nothing
    clock["done"] = 100.0
    assert trace.flush(idle=True) == 3
    lines = [json.loads(x) for x in (tmp_path / "t.jsonl").read_text().splitlines()]
    assert [x["graph"] for x in lines] == ["decode_graph", "decode_rows", "piecewise"]
    assert [x["busy_ms"] for x in lines] == [5.0, 5.0, 5.0]


def test_summary_groups_decodes_by_batch_and_mixed_by_tokens():
    lines = [{"seqs": n, "decodes": n, "tokens": n, "busy_ms": b, "gap_ms": g}
             for n, b, g in [(3, 5.0, None), (8, 6.0, 0.1), (9, 7.0, 0.3), (16, 8.0, 0.5)]]
    lines.append({"seqs": 5, "decodes": 4, "tokens": 304, "busy_ms": 12.0, "gap_ms": 0.2})
    out = summary.summarise(lines, bin_seqs=8, bin_tokens=256)
    assert sorted(out["decode"]) == ["1-8", "9-16"]
    assert out["decode"]["1-8"]["steps"] == 2 and out["decode"]["1-8"]["busy_ms_p50"] == 5.5
    assert out["decode"]["1-8"]["gap_ms_mean"] == 0.1  # the step without a gap is left out
    assert out["decode"]["9-16"]["gap_ms_p50"] == 0.4
    assert list(out["mixed"]) == ["257-512"] and out["mixed"]["257-512"]["busy_ms_mean"] == 12.0
    assert out["total"]["busy_ms"] == 38.0 and out["total"]["gap_ms"] == 1.1
    assert out["total"]["decode_only_steps"] == 4
    assert out["prefill_1-128"] is None and out["prefill_over_128"]["steps"] == 1  # 300 prefill tokens
    lines.append({"seqs": 3, "decodes": 2, "tokens": 130, "busy_ms": 7.0, "gap_ms": 0.0})
    out = summary.summarise(lines, bin_seqs=8, bin_tokens=256)
    assert out["prefill_1-128"]["steps"] == 1 and out["prefill_1-128"]["busy_ms_p90"] == 7.0
    assert out["decode"]["1-8"]["busy_ms_p90"] == 6.0
    assert "graph" not in out  # an older trace: no field, no group
    for line, path in zip(lines, ["decode_graph", "decode_graph", "decode_graph", "eager", "piecewise", "decode_rows"]):
        line["graph"] = path
    out = summary.summarise(lines, bin_seqs=8, bin_tokens=256)
    assert {p: g["steps"] for p, g in out["graph"].items()} == {"decode_graph": 3, "decode_rows": 1, "eager": 1,
                                                                 "piecewise": 1}
    assert out["graph"]["decode_graph"]["busy_ms_p50"] == 6.0 and out["graph"]["piecewise"]["busy_ms_p50"] == 12.0


def test_segments_cut_at_idle_gaps():
    lines = [{"t": t} for t in (0.0, 0.5, 1.0, 9.0, 9.2, 30.0)]
    assert [[x["t"] for x in seg] for seg in summary.segments(lines, 5.0)] == [[0.0, 0.5, 1.0], [9.0, 9.2], [30.0]]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_engine_trace_has_a_line_per_step(tiny_model_dir, tmp_path):
    model_dir = tiny_model_dir("llama")
    prompts = prompt_ids(model_dir)
    llm = make_llm(model_dir, device="cuda", max_num_seqs=16)
    trace = StepTrace(str(tmp_path / "t.jsonl"))
    llm.llm_engine.step_timer = trace
    trace.graph_path_of = lambda: llm.llm_engine.runner.last_graph_path  # as engine/core.py sets it
    llm.generate([{"prompt_token_ids": p} for p in prompts],
                 SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True), use_tqdm=False)
    torch.cuda.synchronize()
    trace.flush(idle=True)
    lines = [json.loads(x) for x in (tmp_path / "t.jsonl").read_text().splitlines()]
    # Every prompt is prefilled once and decoded 11 times (its first token comes from the prefill).
    assert sum(x["tokens"] - x["decodes"] for x in lines) == sum(len(p) for p in prompts)
    assert sum(x["decodes"] for x in lines) == 11 * len(prompts)
    # Attention reads: each prompt's one prefill chunk, then 11 decodes at contexts len(p)+1 .. len(p)+11.
    assert sum(x["context"] for x in lines) == sum(12 * len(p) + sum(range(1, 12)) for p in prompts)
    assert all(x["busy_ms"] > 0 for x in lines) and lines[0]["gap_ms"] is None
    # up to 16 sequences a step: every decode-only step replays a decode graph; a prefill step
    # takes one of the other paths (which depends on its size and the model)
    assert {x["graph"] for x in lines if x["tokens"] == x["decodes"]} == {"decode_graph"}
    assert {x["graph"] for x in lines if x["tokens"] > x["decodes"]} <= set(GRAPH_PATHS) - {"decode_graph"}
