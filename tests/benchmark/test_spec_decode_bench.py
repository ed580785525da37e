"""benchmarks/offline/spec_decode_bench.py (issue #36's H200 plan): the quick grid is a subset of the
full one that keeps every run the targets need, tier 0 first; collect on quick parts says which grid
ran, compares only the vLLM configs that ran, and checks the targets against the parts' figures; the
CPU smoke runs the quick plan end to end in the order the plan gives."""
import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "benchmarks/offline/spec_decode_bench.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("spec_decode_bench", BENCH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


KS, ACCEPTS = [1, 2, 4], [0.0, 0.5, 0.8, 1.0]
TARGET_RUNS = {"adaptive_ngram", "adaptive_draft", "adaptive_draft_a0", "adaptive_replay_a0", "adaptive_empty",
               "k4_draft_a1", "k4_replay_a1", "k4_ngram"}


def test_full_plan_is_the_whole_grid(bench):
    plan = bench.spec_plan("full", KS, ACCEPTS)
    names = [p[1] for p in plan]
    expected = ["adaptive_ngram", "adaptive_draft", "adaptive_draft_a0", "adaptive_replay_a0", "adaptive_empty"]
    for k in KS:
        expected.append(f"k{k}_ngram")
        for a in ACCEPTS:
            expected += [f"k{k}_draft_a{a:g}", f"k{k}_replay_a{a:g}"]
    assert names == expected and len(names) == 32


def test_quick_plan_is_a_subset_with_the_targets_first(bench):
    full = {p[1]: p[2:] for p in bench.spec_plan("full", KS, ACCEPTS)}
    quick = bench.spec_plan("quick", KS, ACCEPTS)
    names = [p[1] for p in quick]
    assert len(names) == len(set(names)) == 18
    # Each quick run is the full grid's run of the same name: same k, policy, proposer and a.
    assert all(full[p[1]] == p[2:] for p in quick)
    tiers = [p[0] for p in quick]
    assert tiers == sorted(tiers) and {p[1] for p in quick if p[0] == 0} == TARGET_RUNS
    # The acceptance sweep at k = 4 only; k = 1, 2 at a = 1 only.
    assert {n for n in names if n.startswith("k4_")} == {"k4_ngram"} | {
        f"k4_{kind}_a{a:g}" for kind in ("draft", "replay") for a in ACCEPTS}
    assert {n for n in names if n[:2] in ("k1", "k2")} == {f"k{k}_{kind}_a1" for k in (1, 2)
                                                           for kind in ("draft", "replay")}
    with pytest.raises(SystemExit, match="--grid"):
        bench.spec_plan("fast", KS, ACCEPTS)


def _part(path: Path, commit: str, grid: str | None, results: dict) -> None:
    setup = {"model": "llama-3.1-8b", "prompt_len": 128, "output_len": 128, "batches": [1, 8, 32, 128],
             "ks": KS, "accepts": ACCEPTS, "max_model_len": 1024, "grid": grid}
    host = {"cpu": "GPU host", "logical_cpus": 16, "python_loop_ms": 7.0}
    path.write_text(json.dumps({"device": "NVIDIA H200", "commit": commit, "host": host, "setup": setup,
                                "results": results}))


def test_collect_on_quick_parts(bench, tmp_path):
    parts = tmp_path / "parts"
    parts.mkdir()
    batches = [1, 8, 32, 128]
    off = {b: 5.0 + b / 32 for b in batches}
    spec = {}
    for b in batches:
        runs = {name: {"tpot_ms": off[b] * 0.5} for name in TARGET_RUNS}
        runs["adaptive_draft_a0"] = {"tpot_ms": off[b] * (1.01 if b < 128 else 1.05)}  # b128 misses
        runs["k4_replay_a1"] = {"tpot_ms": off[b] * 0.3}
        spec[f"b{b}"] = runs
    _part(parts / "ours_off.json", "abc1234", "full", {"engine_seconds": 50.0} | {
        f"b{b}": {"off": {"tpot_ms": off[b]}} for b in batches})
    _part(parts / "ours_spec_b1_8_32_128_quick.json", "abc1234", "quick", {"engine_seconds": 80.0} | spec)
    vllm_tpot = {"draft_model_k4": 4.0, "ngram_k4": 2.0, "off": 6.0}
    for config, t in vllm_tpot.items():
        _part(parts / f"vllm_{config}.json", "vllm", "full", {"engine_seconds": 90.0} | {
            f"b{b}": {"tpot_ms": t} for b in batches})
    out = tmp_path / "spec_decode.json"
    bench.collect(parts, out, batches, KS)
    doc = json.loads(out.read_text())
    assert doc["config"]["grids"] == {"ours_spec_b1_8_32_128_quick": "quick"}
    assert doc["config"]["vllm_configs"] == sorted(vllm_tpot)
    assert doc["commit"] == "abc1234" and doc["host"]["cpu"] == "GPU host"
    r = doc["ratios"]
    for b in batches:
        assert r[f"tpot_draft_k4_b{b}_over_vllm"] == round(off[b] * 0.5 / 4.0, 3)
        assert r[f"tpot_ngram_k4_b{b}_over_vllm"] == round(off[b] * 0.5 / 2.0, 3)
        assert r[f"tpot_off_b{b}_over_vllm"] == round(off[b] / 6.0, 3)
    assert not any(re.match(r"tpot_(draft|ngram)_k[12]_", n) for n in r)  # those vLLM configs did not run
    assert r["tpot_b1_k4_a100_over_off"] == 0.3
    t = doc["targets"]
    assert t["b1_k4_a100_replay_tpot_over_off"] == {"value": 0.3, "limit": 0.4, "met": True}
    assert t["b1_k4_a100_draft_tpot_over_off"]["met"] is False  # 0.5
    assert t["adaptive_tpot_over_off_worst"] == {"value": 1.05, "limit": 1.02, "met": False}
    worst_vs_vllm = max(round(off[b] * 0.5 / 2.0, 3) for b in batches)
    assert t["tpot_over_vllm_worst"] == {"value": worst_vs_vllm, "limit": 1.0, "met": worst_vs_vllm <= 1.0}


def test_smoke_runs_the_quick_plan_in_tier_order(bench, tmp_path):
    out = tmp_path / "spec_decode.json"
    proc = subprocess.run([sys.executable, str(BENCH), "smoke", "--grid", "quick", "--parts", str(tmp_path / "parts"),
                           "--output", str(out)], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ran = re.findall(r"ours spec b(\d+) (\S+):", proc.stdout)
    plan = bench.spec_plan("quick", [1, 4], [0.0, 1.0])  # smoke's ks and accepts
    expected = [(str(b), p[1]) for tier in (0, 1) for b in (1, 4) for p in plan if p[0] == tier]
    assert ran == expected
    part = json.loads((tmp_path / "parts/ours_spec_quick.json").read_text())
    assert part["setup"]["grid"] == "quick"
    assert all(r["output_tokens"] == 8 * int(b[1:]) for b, runs in part["results"].items() if b.startswith("b")
               for r in runs.values())
    doc = json.loads(out.read_text())
    assert doc["config"]["grids"] == {"ours_spec_quick": "quick"} and set(doc["targets"]) == {
        "b1_k4_a100_replay_tpot_over_off", "b1_k4_a100_draft_tpot_over_off", "adaptive_tpot_over_off_worst",
        "tpot_over_vllm_worst"}
