"""benchmarks/offline/spec_decode_bench.py (issue #36's H200 plan): the quick grid is a subset of the
full one that keeps every run the targets need, tier 0 first; collect on quick parts says which grid
ran, compares only the vLLM configs that ran on our checkpoint, refuses our parts of different weights,
and checks the targets against the parts' figures; the CPU smoke writes a checkpoint and runs the
quick plan end to end on it in the order the plan gives, its outputs HF's greedy ones on that
checkpoint."""
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


CKPT = {"load_format": "auto", "dir": "spec_ckpt", "model": "llama-3.1-8b", "seed": 0, "config_sha256": "c" * 64,
        "first_shard": "model-00001-of-00004.safetensors", "first_shard_mib_sha256": "a" * 64}
DUMMY = {"load_format": "dummy", "model": "llama-3.1-8b", "config_sha256": "c" * 64}


def _part(path: Path, commit: str, grid: str | None, results: dict, weights: dict | None = CKPT) -> None:
    setup = {"model": "llama-3.1-8b", "prompt_len": 128, "output_len": 128, "batches": [1, 8, 32, 128],
             "ks": KS, "accepts": ACCEPTS, "max_model_len": 1024, "grid": grid}
    host = {"cpu": "GPU host", "logical_cpus": 16, "python_loop_ms": 7.0}
    doc = {"device": "NVIDIA H200", "commit": commit, "host": host, "setup": setup, "results": results}
    if weights is not None:  # None: a part written before parts recorded their weights
        doc["weights"] = weights
    path.write_text(json.dumps(doc))


VLLM_TPOT = {"draft_model_k4": 4.0, "ngram_k4": 2.0, "off": 6.0}


def _quick_parts(parts: Path, batches: list[int], vllm_weights: dict | None = CKPT, ours_weights=(CKPT, CKPT)) -> dict:
    """Our two quick parts (off, spec) on ours_weights and vLLM's three on vllm_weights; returns our off
    TPOT per batch."""
    parts.mkdir()
    off = {b: 5.0 + b / 32 for b in batches}
    spec = {}
    for b in batches:
        runs = {name: {"tpot_ms": off[b] * 0.5} for name in TARGET_RUNS}
        runs["adaptive_draft_a0"] = {"tpot_ms": off[b] * (1.01 if b < 128 else 1.05)}  # b128 misses
        runs["k4_replay_a1"] = {"tpot_ms": off[b] * 0.3}
        spec[f"b{b}"] = runs
    _part(parts / "ours_off.json", "abc1234", "full", {"engine_seconds": 50.0} | {
        f"b{b}": {"off": {"tpot_ms": off[b]}} for b in batches}, weights=ours_weights[0])
    _part(parts / "ours_spec_b1_8_32_128_quick.json", "abc1234", "quick", {"engine_seconds": 80.0} | spec,
          weights=ours_weights[1])
    for config, t in VLLM_TPOT.items():
        _part(parts / f"vllm_{config}.json", "vllm", "full", {"engine_seconds": 90.0} | {
            f"b{b}": {"tpot_ms": t} for b in batches}, weights=vllm_weights)
    return off


def test_collect_on_quick_parts(bench, tmp_path):
    parts = tmp_path / "parts"
    batches = [1, 8, 32, 128]
    off = _quick_parts(parts, batches)
    out = tmp_path / "spec_decode.json"
    bench.collect(parts, out, batches, KS)
    doc = json.loads(out.read_text())
    assert doc["config"]["grids"] == {"ours_spec_b1_8_32_128_quick": "quick"}
    assert doc["config"]["vllm_configs"] == doc["config"]["vllm_compared"] == sorted(VLLM_TPOT)
    assert doc["config"]["weights"] == CKPT and doc["config"]["load_format"] == "auto"
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


def test_collect_gives_no_ratio_for_an_unsteady_run(bench, tmp_path):
    """A run whose timed two-token generate took over 1.25x its warm-up (a one-off inside it makes
    the TPOT too small) gives no ratio and is listed; 1.25x itself still counts; the target over
    a missing ratio is not judged."""
    parts, batches = tmp_path / "parts", [1, 8, 32, 128]
    off = _quick_parts(parts, batches)
    f = parts / "vllm_draft_model_k4.json"
    doc = json.loads(f.read_text())
    doc["results"]["b32"] |= {"two_token_seconds": 0.70, "warmup_seconds": 0.45}
    doc["results"]["b8"] |= {"two_token_seconds": 0.50, "warmup_seconds": 0.40}  # exactly 1.25x
    f.write_text(json.dumps(doc))
    out = tmp_path / "spec_decode.json"
    bench.collect(parts, out, batches, KS)
    doc = json.loads(out.read_text())
    assert doc["config"]["unsteady_runs"] == ["vllm draft_model_k4 b32"]
    r = doc["ratios"]
    assert r["tpot_draft_k4_b32_over_vllm"] is None
    assert r["tpot_draft_k4_b8_over_vllm"] == round(off[8] * 0.5 / 4.0, 3)
    assert doc["targets"]["tpot_over_vllm_worst"]["met"] is None


OTHER_SEED = CKPT | {"seed": 1, "first_shard_mib_sha256": "b" * 64}


@pytest.mark.parametrize("ours_w, vllm_w, why", [
    (CKPT, DUMMY, "dummy weights"), (CKPT, None, "dummy weights"),  # None: a part from before weights records
    (CKPT, OTHER_SEED, "another checkpoint"), (DUMMY, DUMMY, "dummy weights")])
def test_collect_sets_against_vllm_only_its_parts_on_our_checkpoint(bench, tmp_path, ours_w, vllm_w, why):
    batches = [1, 8, 32, 128]
    off = _quick_parts(tmp_path / "parts", batches, vllm_weights=vllm_w, ours_weights=(ours_w, ours_w))
    out = tmp_path / "spec_decode.json"
    res = bench.collect(tmp_path / "parts", out, batches, KS)
    doc = json.loads(out.read_text())
    assert doc["config"]["vllm_configs"] == sorted(VLLM_TPOT) and doc["config"]["vllm_compared"] == []
    assert set(res["vllm_not_compared"]) == set(VLLM_TPOT) and all(
        why in reason for reason in res["vllm_not_compared"].values())
    assert doc["config"]["load_format"] == ours_w["load_format"]
    assert not any(n.endswith("_over_vllm") for n in doc["ratios"])
    assert doc["targets"]["tpot_over_vllm_worst"] == {"value": None, "limit": 1.0, "met": None}
    assert doc["ratios"]["adaptive_over_off_b8"] == round(off[8] * 0.5 / off[8], 3)  # ours still collected
    assert "not compared" in doc["baselines"]["vllm"]


@pytest.mark.parametrize("spec_w", [OTHER_SEED, DUMMY, None])
def test_collect_refuses_our_parts_of_different_weights(bench, tmp_path, spec_w):
    _quick_parts(tmp_path / "parts", [1, 8, 32, 128], ours_weights=(CKPT, spec_w))
    with pytest.raises(SystemExit, match="our parts ran different weights"):
        bench.collect(tmp_path / "parts", tmp_path / "spec_decode.json", [1, 8, 32, 128], KS)


def hf_greedy(model_dir: Path, prompt: list[int], n: int) -> list[int]:
    """n greedy tokens of HF transformers' model on the checkpoint, fp32, a full forward a token."""
    import torch
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(model_dir).float().eval()
    ids = torch.tensor([prompt])
    with torch.no_grad():
        for _ in range(n):
            ids = torch.cat([ids, model(ids).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    return ids[0, len(prompt):].tolist()


def test_smoke_on_a_checkpoint_runs_the_quick_plan_in_tier_order(bench, tmp_path):
    out, ckpt = tmp_path / "spec_decode.json", tmp_path / "ckpt"
    stale = tmp_path / "ckpt.partial12345"  # what a killed writer leaves: the next one removes it
    stale.mkdir()
    (stale / "model.safetensors").write_bytes(b"half")
    proc = subprocess.run([sys.executable, str(BENCH), "smoke", "--grid", "quick", "--parts", str(tmp_path / "parts"),
                           "--output", str(out), "--weights", str(ckpt)],
                          capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ran = re.findall(r"ours spec b(\d+) (\S+):", proc.stdout)
    plan = bench.spec_plan("quick", [1, 4], [0.0, 1.0])  # smoke's ks and accepts
    expected = [(str(b), p[1]) for tier in (0, 1) for b in (1, 4) for p in plan if p[0] == tier]
    assert ran == expected
    part = json.loads((tmp_path / "parts/ours_spec_quick.json").read_text())
    off = json.loads((tmp_path / "parts/ours_off.json").read_text())
    assert part["setup"]["grid"] == "quick"
    assert all(r["output_tokens"] == 8 * int(b[1:]) for b, runs in part["results"].items() if b.startswith("b")
               for r in runs.values())
    # Both parts record the checkpoint the smoke wrote, and collect carries it.
    record = bench.weights_record(ckpt, ckpt)
    assert record["load_format"] == "auto" and record["seed"] == 0 and len(record["first_shard_mib_sha256"]) == 64
    assert part["weights"] == off["weights"] == record
    assert not stale.exists() and sorted(p.name for p in tmp_path.glob("ckpt*")) == ["ckpt"]
    with pytest.raises(SystemExit, match="exists"):  # never written over
        bench.write_checkpoint(bench.MODEL, ckpt)
    doc = json.loads(out.read_text())
    assert doc["config"]["weights"] == record and doc["config"]["load_format"] == "auto"
    assert doc["config"]["grids"] == {"ours_spec_quick": "quick"} and set(doc["targets"]) == {
        "b1_k4_a100_replay_tpot_over_off", "b1_k4_a100_draft_tpot_over_off", "adaptive_tpot_over_off_worst",
        "tpot_over_vllm_worst"}
    # The target ran the checkpoint's weights (not dummy ones): its greedy output is HF's on it.
    prompt = bench.make_prompts(1, 16, 512)[0]  # smoke's prompt_len, the tiny config's vocabulary
    assert off["results"]["b1"]["off"]["sample_output_ids"] == hf_greedy(ckpt, prompt, 8)
    # The draft is the same checkpoint: uncorrupted proposals of draft = target are all accepted (fp32).
    for b in ("b1", "b4"):
        assert part["results"][b]["k4_draft_a1"]["acceptance_rate"] == 1.0
        assert all(r["warmup_seconds"] > 0 for r in part["results"][b].values())


def _run(tpot, tps, acc=None):
    return {"tpot_ms": tpot, "output_tokens_per_s": tps, "acceptance_rate": acc}


def test_plot_series_takes_each_run_where_the_figure_draws_it(bench, tmp_path):
    """plot: x is the measured acceptance (not the asked a), sorted; the k curve starts at off (k = 0);
    vLLM's draft = target point comes only from a part on our checkpoint; the PNG is written."""
    from spec_bench.plot import plot, series
    ours = {"off": _run(5.0, 100.0), "k4_replay_a1": _run(1.5, 300.0, 0.98), "k4_replay_a0": _run(6.0, 80.0, 0.0),
            "k4_draft_a0.5": _run(12.0, 40.0, 0.3), "k4_draft_a1": _run(7.0, 70.0, 0.85),
            "k1_replay_a1": _run(3.0, 160.0, 1.0), "k2_draft_a1": _run(6.5, 75.0, 0.9),
            "adaptive_ngram": _run(5.01, 99.0)}
    doc = {"device": "test", "commit": "0" * 40, "date": "today",
           "config": {"vllm_compared": ["draft_model_k4"]},
           "results": {"ours": {"b8": ours}, "vllm": {"draft_model_k4": {"b8": _run(9.0, 55.0, 0.8)}}}}
    got = series(doc)
    assert list(got) == [8]
    row = got[8]
    assert row["off"] == (5.0, 100.0)
    assert row["accept"]["replay"] == [(0.0, 6.0, 80.0), (0.98, 1.5, 300.0)]
    assert row["accept"]["draft"] == [(0.3, 12.0, 40.0), (0.85, 7.0, 70.0)]
    assert row["k"]["replay"] == [(0, 5.0, 100.0), (1, 3.0, 160.0), (4, 1.5, 300.0)]
    assert row["k"]["draft"] == [(0, 5.0, 100.0), (2, 6.5, 75.0), (4, 7.0, 70.0)]
    assert row["vllm"] == [(0.8, 9.0, 55.0)]
    doc["config"]["vllm_compared"] = []  # a vLLM part of other weights is not drawn against ours
    assert series(doc)[8]["vllm"] == []
    out = tmp_path / "f.png"
    plot(doc, out)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_covers_every_batch_of_the_committed_h200_result(bench):
    from spec_bench.plot import series
    doc = json.loads((ROOT / "benchmarks/results/h200/spec_decode.json").read_text())
    got = series(doc)
    assert sorted(got) == sorted(int(b[1:]) for b in doc["results"]["ours"] if re.fullmatch(r"b\d+", b))
    for b, row in got.items():
        runs = doc["results"]["ours"][f"b{b}"]
        for kind in ("replay", "draft"):
            asked = [n for n in runs if n.startswith(f"k4_{kind}_a")]
            assert len(row["accept"][kind]) == len(asked) >= 2
            assert {p[1] for p in row["accept"][kind]} == {runs[n]["tpot_ms"] for n in asked}
