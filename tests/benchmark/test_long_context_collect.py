"""benchmarks/serving/long_context.py without a GPU: its scenarios are the lengths and arrivals it
says, and collect turns per-request records into the issue's ratios, including the running
decodes' gaps while the 100k prompt prefills (only the gaps that end inside that window)."""
import argparse
import itertools
import json
import os
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks/serving"))
import long_context as lc  # noqa: E402
from pagedserve.attention import gathered_prefill_plan as plan  # noqa: E402


def _args(**kw):
    base = dict(n8k=3, rate8k=1.0, n32k=2, rate32k=0.25, n100k=2, rate100k=0.1, mix_short_rate=2.0,
                mix_long_rate=0.1, mix_seconds=10.0, prefill_decodes=4, prompt_scale=1.0,
                decode_output_len=1024)
    return argparse.Namespace(**{**base, **kw})


def test_scenarios_have_their_lengths_and_arrivals():
    args = _args()
    r8 = lc.scenario_requests("len8k", args)
    assert [len(r.prompt_token_ids) for r in r8] == [8192] * 3 and {r.output_len for r in r8} == {256}
    assert r8[0].arrival_time == 0 and r8 == sorted(r8, key=lambda r: r.arrival_time)
    assert [r.prompt_token_ids for r in lc.scenario_requests("len8k", args)] == [r.prompt_token_ids for r in r8]
    assert {len(r.prompt_token_ids) for r in lc.scenario_requests("len100k", args)} == {100_000}
    mix = lc.scenario_requests("mix", args)
    longs = [r for r in mix if len(r.prompt_token_ids) >= lc.SHORT_MAX_PROMPT]
    assert len(longs) == 1 and len(mix) == 21 and all(r.output_len <= 256 for r in mix)
    assert [r.arrival_time for r in mix] == sorted(r.arrival_time for r in mix)
    pre = lc.scenario_requests("prefill100k", args)
    assert [len(r.prompt_token_ids) for r in pre] == [128] * 4 + [100_000] and pre[-1].arrival_time == 5.0
    # No scenario finds another's prompts cached: their first blocks (16 tokens) all differ.
    firsts = [tuple(r.prompt_token_ids[:16]) for name in ("len8k", "len32k", "len100k", "mix")
              for r in lc.scenario_requests(name, args) if len(r.prompt_token_ids) >= 8192]
    assert len(firsts) == 3 + 2 + 2 + 1 == len(set(firsts))


def _req(prompt_len, ttft, gaps, sent_at=0.0, latency=None):
    return {"prompt_len": prompt_len, "expected_output_len": len(gaps) + 1, "output_len": len(gaps) + 1,
            "ttft": ttft, "latency": latency if latency is not None else ttft + sum(gaps), "itl": gaps,
            "error": None, "sent_at": sent_at}


def test_prefill_window_counts_the_gaps_that_end_inside_it():
    # decodes every 0.1 s from t=0.1, one 0.9 s gap; the 100k prompt sent at 1.0, first token at 3.0
    short = _req(128, 0.1, [0.1] * 8 + [0.9] + [0.1] * 20)
    long = _req(100_000, 2.0, [0.05], sent_at=1.0)
    s = lc.prefill_window_stats({"requests": [short, long]})
    times = lc.token_times(short)
    during = [b - a for a, b in zip(times, times[1:]) if 1.0 <= b <= 3.0]
    assert s["gaps_during"] == len(during) == 12 and s["prefill_s"] == 2.0
    assert s["itl_max_during"] == pytest.approx(900.0)
    assert s["itl_p50_before"] == pytest.approx(100.0)


def test_gap_classes_exclude_long_prefills_and_class_by_what_decodes():
    """A short request's gaps: those inside the long prompt's prefill are left out, the rest classed
    by how many long and short requests were decoding at their middle."""
    short = _req(128, 0.1, [0.1] * 30)                # gaps' middles at 0.15, 0.25, ..., 3.05 s
    others = [_req(128, 0.1, [0.1] * 5)] * 3          # three more decoding until 0.6 s
    long = _req(32768, 1.0, [0.1] * 10, sent_at=1.0)  # prefills 1.0-2.0, decodes 2.0-3.0
    classes = lc.gap_classes({"requests": [short, *others, long]}, [short])
    # 0.15-0.55: four shorts decoding; 0.65-0.95 and 3.05: one; 1.05-1.95 left out; 2.05-2.95: the long one
    assert {k: len(v) for k, v in classes.items()} == {"long0_short4+": 5, "long0_short0+": 5, "long1_short0+": 10}
    assert all(g == pytest.approx(100.0) for v in classes.values() for g in v)


def test_matched_gap_ratio_compares_like_steps_with_like():
    """Pooled, these medians would be 5 against 10 ms; class for class the engines are level."""
    ours = {"long1": {"n": 100, "median_ms": 5.0}, "long2": {"n": 30, "median_ms": 10.0}}
    theirs = {"long1": {"n": 30, "median_ms": 5.0}, "long2": {"n": 100, "median_ms": 10.0}}
    assert lc.matched_gap_ratio(ours, theirs) == 1.0
    theirs["long1"]["median_ms"] = 4.0  # ours 1.25x on long1, level on long2, equal weights
    assert lc.matched_gap_ratio(ours, theirs) == pytest.approx(1.25 ** 0.5, abs=1e-3)
    assert lc.matched_gap_ratio(ours, {"long2": {"n": 19, "median_ms": 1.0}}) is None  # too few gaps


def test_collect_writes_the_ratios(tmp_path):
    work = tmp_path / "work"
    work.mkdir()
    for engine, scale in (("vllm", 1.0), ("pagedserve", 0.8)):
        info = {"startup_seconds": 60 * scale, "commit": None}
        if engine == "pagedserve":  # as the server ran; the collecting process has no such switch set
            info["env_switches"] = {"PAGEDSERVE_LONG_PREFILL": "cudnn", "PAGEDSERVE_FUSED": None}
        (work / f"lc_{engine}_info.json").write_text(json.dumps(info))
        for scenario, plen in (("len8k", 8192), ("len32k", 32768), ("len100k", 100_000)):
            reqs = [_req(plen, 0.5 * scale * (i + 1), [0.02 * scale] * 255, sent_at=i) for i in range(4)]
            if engine == "vllm":  # its first chunk carried 1 + 10 tokens: 10 gaps fewer, as many tokens
                for r in reqs:
                    r["itl"] = r["itl"][10:]
            (work / f"lc_{engine}_{scenario}.json").write_text(json.dumps({"duration_s": 10.0, "requests": reqs}))
        mix = [_req(200, 0.05 * scale, [0.01 * scale] * 99, sent_at=i * 0.5) for i in range(10)]
        mix += [_req(32768, 2.0, [0.03] * 255, sent_at=1.0)]
        (work / f"lc_{engine}_mix.json").write_text(json.dumps({"duration_s": 10.0, "requests": mix}))
        pre = [_req(128, 0.1, [0.02 * scale] * 100), _req(100_000, 1.0, [0.05], sent_at=0.5)]
        (work / f"lc_{engine}_prefill100k.json").write_text(json.dumps({"duration_s": 5.0, "requests": pre}))
    alt = tmp_path / "alt"
    alt.mkdir()
    (alt / "lc_pagedserve_info.json").write_text(json.dumps({"startup_seconds": 50, "server_args": "--x"}))
    (alt / "lc_pagedserve_len8k.json").write_text((work / "lc_vllm_len8k.json").read_text())
    out = tmp_path / "long_context.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith("PAGEDSERVE_")}
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks/serving/long_context.py"), "collect", "--work",
                        str(work), "--device", "NVIDIA H200", "--output", str(out), "--alt-work", f"pw={alt}",
                        "--date", "2026-12-04"],
                       capture_output=True, text=True, cwd=ROOT, env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    result = json.loads(out.read_text())
    assert result["date"] == "2026-12-04"  # the runs' day, not the collection's
    ratios = result["ratios"]
    alt_runs = result["results"]["pagedserve_pw"]
    assert alt_runs["server_args"] == "--x" and list(alt_runs["runs"]) == ["8k"]
    assert alt_runs["runs"]["8k"] == result["results"]["vllm"]["runs"]["8k"]  # the same file, the same figures
    alt_ratios = alt_runs["ratios_over_vllm"]  # its own, beside the headline's; none where it has no figure
    assert alt_ratios["tpot_p50_over_vllm_8k"] == alt_ratios["throughput_over_vllm_8k"] == 1.0
    assert alt_ratios["tpot_p50_over_vllm_32k"] is None and alt_ratios["startup_seconds_over_vllm"] == round(50 / 60, 3)
    for key in ("8k", "32k", "100k", "mix_short"):
        assert ratios[f"tpot_p50_over_vllm_{key}"] == pytest.approx(0.8, abs=1e-3)
        assert ratios[f"tpot_p99_over_vllm_{key}"] == pytest.approx(0.8, abs=1e-3)
        assert ratios[f"ttft_p50_over_vllm_{key}"] == pytest.approx(0.8, abs=1e-3)
    assert ratios["ttft_p99_over_vllm_8k"] == pytest.approx(0.8, abs=1e-3)
    assert ratios["throughput_over_vllm_8k"] == 1.0  # same tokens in the same time
    assert ratios["decode_itl_p50_during_100k_prefill_over_vllm"] == pytest.approx(0.8, abs=1e-3)
    assert ratios["startup_seconds_over_vllm"] == pytest.approx(0.8)
    runs = {e: result["results"][e]["runs"] for e in ("vllm", "pagedserve")}
    assert runs["vllm"]["32k"]["coalesced_tokens_p50"] == 10 and runs["pagedserve"]["32k"]["coalesced_tokens_p50"] == 0
    # Beside them: decode gaps step mix for step mix (every gap 0.016 s against 0.02), and the first
    # tokens' ready times with vLLM's 10 coalesced tokens taken back out of its TTFT at 20 ms each.
    for key in ("8k", "32k", "100k", "mix_short"):
        assert ratios[f"decode_gap_matched_over_vllm_{key}"] == pytest.approx(0.8, abs=1e-3)
    ready = {e: sorted(1000 * (0.5 * s * (i + 1)) - c for i in range(4))
             for e, s, c in (("vllm", 1.0, 200.0), ("pagedserve", 0.8, 0.0))}
    assert runs["vllm"]["32k"]["first_token_ready_p50_estimate"] == pytest.approx((ready["vllm"][1] + ready["vllm"][2]) / 2)
    assert ratios["first_token_ready_p50_over_vllm_32k"] == pytest.approx(1000 / 1050, abs=1e-3)
    # ... and the TPOT counted from there: vLLM's 255 tokens then took its 5.1 s of gaps plus the 0.2 s
    # its coalesced tokens were moved out of, where its measured TPOT leaves those 0.2 s out.
    assert runs["vllm"]["32k"]["tpot_p50"] == pytest.approx(20.0)
    assert runs["vllm"]["32k"]["tpot_from_ready_p50_estimate"] == pytest.approx(1000 * 5.3 / 255, abs=0.01)  # (rounded to 0.01 ms)
    assert runs["pagedserve"]["32k"]["tpot_from_ready_p50_estimate"] == pytest.approx(16.0, abs=1e-3)
    assert ratios["tpot_from_ready_p50_over_vllm_32k"] == pytest.approx(16.0 * 255 / 5300, abs=1e-3)
    assert ratios["tpot_from_ready_p99_over_vllm_100k"] == pytest.approx(16.0 * 255 / 5300, abs=1e-3)
    # The switches recorded are the measured server's, not the collecting process's.
    assert result["switches"]["PAGEDSERVE_LONG_PREFILL"] == "cudnn"
    assert "PAGEDSERVE_LONG_PREFILL=cudnn" in out.with_suffix(".md").read_text()


def test_prefill_phase_times_each_length_under_the_environments_switches(tiny_model_dir, tmp_path, monkeypatch):
    """`long_context.py prefill` (long_h200.sh prefill_ab): one engine, one request per length,
    their seconds and the switches it ran under in the file."""
    monkeypatch.setenv("PAGEDSERVE_LONG_PREFILL", "cudnn")  # recorded; on CPU the path stays off
    out = tmp_path / "p.json"
    argv = ["prefill", "--model", str(tiny_model_dir("llama")), "--max-model-len", "256", "--block-size", "8",
            "--prefill-lens", "40", "200", "40", "--out", str(out), "--max-num-batched-tokens", "64",
            "--beside-decodes", "2", "--cost-scales", "1", "0", "--decode-output-len", "64", "--chunk-align", "16"]
    monkeypatch.setattr(sys, "argv", ["long_context.py", *argv])
    days = {time.strftime("%Y-%m-%d", time.gmtime())}
    lc.main()
    days.add(time.strftime("%Y-%m-%d", time.gmtime()))
    rec = json.loads(out.read_text())
    # The command that wrote the file, as one would type it from the repo root, and the day.
    assert shlex.split(rec["command"]) == ["python3", "benchmarks/serving/long_context.py", *argv]
    assert rec["date"] in days
    secs = rec["prefill_seconds"]
    assert list(secs) == ["40", "200"] and [len(secs["40"]), len(secs["200"])] == [2, 1]
    assert all(s > 0 for runs in secs.values() for s in runs)
    assert rec["env_switches"]["PAGEDSERVE_LONG_PREFILL"] == "cudnn" and rec["block_size"] == 8
    assert rec["startup_seconds"] > 0 and rec["commit"] and rec["engine"] == "pagedserve"
    assert rec["max_num_batched_tokens"] == 64 and rec["gathered_min_prefix"] == plan.MIN_PREFIX
    assert rec["long_prefill_chunk_align"] == 16  # --chunk-align, as the engine's scheduler took it
    # Then the last length again beside 2 decoding requests, once per cost scale: its steps are the
    # decodes' gaps, at least one a chunk of the 64-token budget less the decodes' tokens.
    rows = rec["beside_decodes"]
    assert [(r["decodes"], r["cost_scale"], r["prompt_len"]) for r in rows] == [(2, 1.0, 40), (2, 0.0, 40)]
    assert all(r["steps"] >= 1 and r["prefill_s"] > 0 and r["gap_p50_ms"] <= r["gap_max_ms"] for r in rows)
    # Each step's chunk of the prompt: they add up to it, one a step, none past the budget.
    assert all(sum(r["chunks"]) == 40 and len(r["chunks"]) == r["steps"] and max(r["chunks"]) <= 64 for r in rows)


def test_prefill_beside_decodes_runs_each_length_and_alignment_in_one_engine(tiny_model_dir, tmp_path):
    """--beside-lens, --beside-aligns and --beside-repeats: every (length, alignment, decodes, scale)
    row from one start-up, each prompt's chunks those of its alignment (a chunk the budget cut short
    ends on a multiple of it), and the engine's own alignment back afterwards."""
    out = tmp_path / "p.json"
    lc.phase_prefill(argparse.Namespace(model=tiny_model_dir("llama"), max_model_len=256, block_size=8,
                                        prefill_lens=[40], out=str(out), profile=False, max_num_batched_tokens=32,
                                        gathered_min_prefix=None, beside_decodes=[1], cost_scales=[0.0],
                                        decode_output_len=64, beside_lens=[100, 60], beside_aligns=[16, 8],
                                        trace=None, engine="pagedserve", near_end=0, drains=[0], chunk_align=0,
                                        step_times=False, gather_modes=[], beside_repeats=2,
                                        beside_decode_prompt_len=128))
    rec = json.loads(out.read_text())
    rows = rec["beside_decodes"]
    # --beside-repeats 2: the whole list twice over, so the arms alternate in time
    assert [(r["repeat"], r["prompt_len"], r["chunk_align"]) for r in rows] == [
        (rep, n, a) for rep in (0, 1) for n, a in [(100, 16), (100, 8), (60, 16), (60, 8)]]
    for r in rows:
        ends = list(itertools.accumulate(c for c in r["chunks"] if c))  # 0: a step without it
        assert ends[-1] == r["prompt_len"]
        # budget 32 less the decode's token: 31, cut to its alignment (the last chunk is all that is left)
        assert all(e % r["chunk_align"] == 0 for e in ends[:-1]) and ends[0] > r["chunk_align"] // 2, r["chunks"]
    assert rec["long_prefill_chunk_align"] == 0


def test_prefill_beside_long_decodes_starts_once_their_prompts_are_in(tiny_model_dir, tmp_path):
    """--beside-decode-prompt-len far past the step budget: the decoding request's prompt takes
    seven steps; the long prompt arrives only after each has its first token, so every step of its
    prefill is the budget less the one decode, cut to the alignment (31 -> 24), its last chunk the
    rest."""
    out = tmp_path / "p.json"
    lc.phase_prefill(argparse.Namespace(model=tiny_model_dir("llama"), max_model_len=512, block_size=8,
                                        prefill_lens=[40], out=str(out), profile=False, max_num_batched_tokens=32,
                                        gathered_min_prefix=None, beside_decodes=[1], cost_scales=[0.0],
                                        decode_output_len=64, beside_lens=[100], beside_aligns=[8],
                                        trace=None, engine="pagedserve", near_end=0, drains=[0], chunk_align=0,
                                        step_times=False, gather_modes=[], beside_decode_prompt_len=200,
                                        beside_repeats=1))
    (row,) = json.loads(out.read_text())["beside_decodes"]
    # from its first step on (a step with the decode's prompt still going in would give it less)
    assert row["chunks"][:4] == [24, 24, 24, 28] and not any(row["chunks"][4:]), row["chunks"]


def test_prefill_gather_modes_alternate_in_one_engine(tiny_model_dir, tmp_path, monkeypatch):
    """`prefill --gather-modes runs always`: each prompt (and beside-decodes run) once per mode, set
    on the running engine before it, the order alternating by prompt; results keyed '<len>-<mode>'
    with the layer-chunks each run read in place and gathered (the path's counters; stood in for
    here, as a CPU engine has no long-prefill path, where the option is an error)."""
    args = dict(model=tiny_model_dir("llama"), max_model_len=256, block_size=8, prefill_lens=[40, 30],
                profile=False, max_num_batched_tokens=64, gathered_min_prefix=None, beside_decodes=[],
                cost_scales=[1.0], decode_output_len=64, beside_lens=[], beside_aligns=[], trace=None,
                engine="pagedserve", near_end=0, drains=[0], chunk_align=None, step_times=False,
                gather_modes=["runs", "always"], beside_repeats=1, beside_decode_prompt_len=128)
    with pytest.raises(SystemExit, match="--gather-modes"):
        lc.phase_prefill(argparse.Namespace(**args, out=str(tmp_path / "cpu.json")))
    modes, counts = [], {"runs": (0, 0)}

    def set_gather(mode):
        modes.append(mode)
        counts["mode"] = mode

    def path_counts():  # each call after a run adds 3 layer-chunks to the mode's column
        a, b = counts["runs"]
        counts["runs"] = (a + 3, b) if counts.get("mode") == "runs" else (a, b + 3)
        return counts["runs"]
    monkeypatch.setattr(lc, "_set_gather", set_gather)
    monkeypatch.setattr(lc, "_path_counts", path_counts)
    out = tmp_path / "p.json"
    lc.phase_prefill(argparse.Namespace(**{**args, "beside_decodes": [1]}, out=str(out)))
    rec = json.loads(out.read_text())
    assert modes == ["runs", "always", "always", "runs", "runs", "always"]  # 40, 30, then beside 30
    assert set(rec["prefill_seconds"]) == {"40-runs", "40-always", "30-runs", "30-always"}
    assert rec["long_chunks_read"] == {"40-runs": [[3, 0]], "40-always": [[0, 3]], "30-always": [[0, 3]],
                                       "30-runs": [[3, 0]]}
    assert [(r["gather"], r["long_chunks_read"]) for r in rec["beside_decodes"]] == [("runs", [3, 0]),
                                                                                      ("always", [0, 3])]


def test_prefill_near_end_times_a_drain_against_none(tiny_model_dir, tmp_path, monkeypatch):
    """`long_context.py prefill --near-end 3 --drains 0 4`: a request 3 tokens from its end meets a
    40-token prompt (the engine's drain minimum lowered to 16 here): off, the prompt's first token
    comes no later than that request's end; draining (40 // 4 = 10 steps allowed), after it."""
    from pagedserve import config as engine_config
    monkeypatch.setattr(engine_config, "COST_MIN_TOKENS", 16)
    out = tmp_path / "p.json"
    lc.phase_prefill(argparse.Namespace(model=tiny_model_dir("llama"), max_model_len=256, block_size=8,
                                        prefill_lens=[40], out=str(out), profile=False, max_num_batched_tokens=64,
                                        gathered_min_prefix=None, beside_decodes=[], cost_scales=[1.0],
                                        decode_output_len=64, trace=None, engine="pagedserve", near_end=3,
                                        drains=[0, 4], chunk_align=None, step_times=True, gather_modes=[]))
    rec = json.loads(out.read_text())
    # --step-times: the 40-token prompt in the engine's own loop, each step timed: a 64-token
    # budget prefills it in one step, its one token ends the request in that step or the next.
    assert list(rec["step_ms"]) == ["40"] and 1 <= len(rec["step_ms"]["40"][0]) <= 2
    assert all(ms > 0 for ms in rec["step_ms"]["40"][0]) and rec["prefill_seconds"]["40"][0] > 0
    # add_request's own milliseconds beside them: with the steps, no more than the prompt's seconds
    admit = rec["add_request_ms"]["40"][0]
    assert 0 < admit and admit + sum(rec["step_ms"]["40"][0]) <= 1e3 * rec["prefill_seconds"]["40"][0] + 1
    rows = rec["near_end"]
    assert [(r["drain"], r["tokens_left"], r["prompt_len"]) for r in rows] == [(0, 3, 40), (4, 3, 40)]
    off, drained = rows
    assert off["prompt_first_token_step"] <= off["decode_end_step"]  # it ran beside the decode
    assert drained["decode_end_step"] < drained["prompt_first_token_step"]


def test_structured_collect_records_the_measured_servers_switches(tmp_path):
    """structured_vs_vllm.py collect, like long_context.py's: the switches in the result are the ones
    the measured server ran with (its info file), not the collecting process's."""
    work = tmp_path / "work"
    work.mkdir()
    (work / "structured_pagedserve_info.json").write_text(json.dumps(
        {"engine": "pagedserve", "server_args": "", "env_switches": {"PAGEDSERVE_GRAMMAR_FILL": "0"}}))
    out = tmp_path / "structured.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith("PAGEDSERVE_")}
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks/serving/structured_vs_vllm.py"), "collect", "--work",
                        str(work), "--device", "NVIDIA H200", "--output", str(out)],
                       capture_output=True, text=True, cwd=ROOT, env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    assert json.loads(out.read_text())["switches"]["PAGEDSERVE_GRAMMAR_FILL"] == "0"


def test_structured_collect_dates_the_result_by_our_runs(tmp_path):
    """The committed lease's phase files collected today: the result's date is the day our runs were
    made (their files'), as vs_vllm.py's collect keeps the lease's, not the collecting day."""
    runs = ROOT / "benchmarks/results/h200/structured_runs"
    work = tmp_path / "work"
    work.mkdir()
    for f in runs.glob("structured_*.json"):
        shutil.copy(f, work / f.name)
    out = tmp_path / "structured.json"
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks/serving/structured_vs_vllm.py"), "collect", "--work",
                        str(work), "--device", "NVIDIA H200", "--output", str(out)],
                       capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-2000:]
    ours = {json.loads(f.read_text())["date"] for f in runs.glob("structured_pagedserve_r*.json")}
    assert len(ours) == 1 and json.loads(out.read_text())["date"] == ours.pop()


def test_replay_cuts_a_prompt_beside_decodes_as_the_scheduler_driven_step_by_step(tmp_path):
    """`long_context.py replay` (the scheduler alone, no model): each row's chunks are what the core
    tests' Driver (the engine played step by step, KV shadowed, invariants checked) gets from a
    scheduler with the same settings; the JSON keeps every row."""
    sys.path.insert(0, str(ROOT / "tests/core"))
    from core_helpers import Driver, make_group, make_scheduler
    from pagedserve.core.chunk_cost import CHUNK_ALIGN, COST_MIN_TOKENS
    out = tmp_path / "replay.json"
    args = argparse.Namespace(model=str(ROOT / "benchmarks/models/llama-3.1-8b"), prefill_lens=[30000],
                              beside_decodes=[1, 3], cost_scales=[2.0, 0.0], chunk_align=None,
                              block_size=16, max_num_batched_tokens=8192, max_model_len=32768, out=str(out))
    rows = lc.phase_replay(args)
    assert json.loads(out.read_text())["rows"] == rows and len(rows) == 4
    for row in rows:
        assert row["chunk_align"] == CHUNK_ALIGN  # unset: the engine's on Hopper
        s = make_scheduler(4000, block_size=16, max_num_batched_tokens=8192, max_model_len=32768,
                           attention_cost_context=row["attention_cost_context"],
                           attention_cost_min_tokens=COST_MIN_TOKENS, long_prefill_chunk_align=CHUNK_ALIGN,
                           enable_prefix_caching=False)
        decs = [make_group(f"d{i}", list(range(128)), max_tokens=2000) for i in range(row["decodes"])]
        for g in decs:
            s.add_seq_group(g)
        d = Driver(s)
        for _ in range(4):
            d.step()
        long_ = make_group("l", list(range(30000)), max_tokens=1)
        s.add_seq_group(long_)
        chunks = []
        while sum(chunks) < 30000:
            out_ = d.step()
            assert sum(x.group in decs for x in out_.scheduled) == row["decodes"]  # the decodes ran beside it
            chunks += [x.num_new_tokens for x in out_.scheduled if x.group is long_]
        assert row["chunks"] == chunks, row
    on, off = rows[0]["chunks"], rows[1]["chunks"]  # costs on cut its deeper chunks finer than tokens alone
    assert any(a < b for a, b in zip(on[:-1], off[:-1])) and all(a <= b for a, b in zip(on[:-1], off[:-1]))


def test_gaps_class_each_gap_by_the_requests_decoding_at_its_middle(tmp_path):
    """`long_context.py gaps`: a gap inside a long prompt's prefill is left out; the others are
    classed by the long and short requests decoding at their middle."""
    long_ = {"prompt_len": 10000, "sent_at": 0.0, "ttft": 1.0, "latency": 1.3, "itl": [0.1, 0.2], "error": None}
    # A short request: its first gap (0.5-0.6 s) is inside the long prompt's prefill, its second
    # (0.6-1.1 s, middle 0.85) too; its third (1.1-1.2 s) beside the long one's decode, its last
    # (1.2-1.5 s, middle 1.35) after the long one ended.
    short = {"prompt_len": 100, "sent_at": 0.4, "ttft": 0.1, "latency": 1.1, "itl": [0.1, 0.5, 0.1, 0.3],
             "error": None}
    (tmp_path / "lc_pagedserve_mix.json").write_text(json.dumps({"requests": [long_, short]}))
    got = lc.phase_gaps(argparse.Namespace(scenario="mix"), tmp_path)
    # The long one's gaps (1.0-1.1, 1.1-1.3): itself and the short one decoding.
    assert got == {"pagedserve": {"long1_short0+": {"n": 3, "median_ms": 100.0},
                                  "long0_short0+": {"n": 1, "median_ms": 300.0}}}


def test_device_timeline_places_the_kernels_in_the_profiled_window():
    """_device_idle on a made-up profile (times in us from the profiler's start): the first kernel's
    start, the kernels' union as busy time (overlaps counted once), the span, and the idle gaps over
    0.2 ms with the kernel before each; host events are not kernels."""
    from types import SimpleNamespace as NS
    def event(kind, start, end, name):
        return NS(device_type=f"DeviceType.{kind}", time_range=NS(start=start, end=end), name=name)
    events = [event("CUDA", 5000, 6000, "gemm"), event("CUDA", 5500, 6500, "attn"),  # overlap: busy 1.5 ms
              event("CPU", 0, 9000, "aten::mm"), event("CUDA", 6600, 7000, "norm"),   # 0.1 ms gap: not counted
              event("CUDA", 7500, 8000, "merge")]                                      # 0.5 ms gap after norm
    timeline = lc._device_idle(NS(events=lambda: events))
    assert timeline["first_kernel_at_ms"] == 5.0 and timeline["span_ms"] == 3.0 and timeline["busy_ms"] == 2.4
    assert timeline["gaps_over_0.2ms"] == 1 and timeline["longest_gaps"] == [{"ms": 0.5, "after": "norm"}]


def test_top_kernels_and_host_ops_keep_apart_under_a_host_profile():
    """--profile-host records the host's torch ops beside the kernels: the kernel table counts only
    device kernels (a host op's device time is its kernels', counted there once), the host table
    only host ops, by self time."""
    from types import SimpleNamespace as NS
    def avg(kind, key, device_us=0.0, self_cpu_us=0.0, count=1):
        return NS(device_type=f"DeviceType.{kind}", key=key, count=count, device_time_total=device_us,
                  self_device_time_total=device_us, self_cpu_time_total=self_cpu_us, cpu_time_total=2 * self_cpu_us)
    rows = [avg("CPU", "aten::mm", device_us=3000, self_cpu_us=500), avg("CUDA", "nvjet_gemm", device_us=3000, count=4),
            avg("CUDA", "merge_parts_kernel", device_us=1000, count=2), avg("CPU", "aten::index_select", self_cpu_us=900)]
    prof = NS(key_averages=lambda: rows)
    assert lc._top_kernels(prof) == [{"kernel": "nvjet_gemm", "calls": 4, "ms": 3.0, "share": 0.75},
                                     {"kernel": "merge_parts_kernel", "calls": 2, "ms": 1.0, "share": 0.25}]
    assert [(r["op"], r["self_ms"], r["total_ms"]) for r in lc._top_host_ops(prof)] == [
        ("aten::index_select", 0.9, 1.8), ("aten::mm", 0.5, 1.0)]
