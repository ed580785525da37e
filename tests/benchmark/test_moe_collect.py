"""benchmarks/offline/moe_collect.py: the parts of several device calls merged into the committed
moe.json. Ours is paired with vLLM's part of the same lease when there is one (flagged when not),
replaced runs keep their figures under `superseded`, untouched runs stay, online ratios are
vs_vllm.py collect's over the phase files, and collecting twice changes nothing."""
import json
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks/offline"))
from moe_collect import collect  # noqa: E402

COMMITTED = ROOT / "benchmarks/results/h200/moe.json"
LEASE = ROOT / "benchmarks/results/h200/serving_runs_0a88c13"  # real online phase files (Llama, rates 10/20/40)


def call(parts: Path, name: str, lease: str, files: dict) -> Path:
    d = parts / name
    d.mkdir(parents=True)
    (d / "lease.txt").write_text(f"{lease} new\n")
    for rel, doc in files.items():
        (d / rel).parent.mkdir(parents=True, exist_ok=True)
        (d / rel).write_text(json.dumps(doc))
    return d


def ours(model: str, runs: dict, commit: str) -> dict:
    return {"commit": commit, "switches": {"fused_moe": {"cuda": "triton"}},
            "results": {f"{model}_{wl}": {"output_tokens_per_s": tps, "runs": [{"output_tokens_per_s": tps}]}
                        for wl, tps in runs.items()},
            "ratios": {f"{model}_nanovllm_decode_roofline_fraction": 0.81} if "nanovllm" in runs else {}}


def theirs(tps: float) -> dict:
    return {"results": {"output_tok_s": tps, "runs": [{"output_tok_s": tps}]}}


def test_collect_merges_parts_into_moe_json(tmp_path):
    out = tmp_path / "moe.json"
    shutil.copy(COMMITTED, out)
    before = json.loads(out.read_text())
    parts = tmp_path / "parts"
    q = "qwen3-30b-a3b"
    call(parts, "q1_tune_layer", "L1", {"moe_layer.json": {"commit": "c1", "ratios": {f"{q}_layer_b1_over_vllm": 1.2}}})
    call(parts, "q2_qwen", "L2", {f"moe_offline_{q}.json": ours(q, {"nanovllm": 7000.0}, "c2"),
                                  f"vllm_{q}_nanovllm.json": theirs(6000.0)})
    call(parts, "q3_other_lease", "L3", {f"vllm_{q}_nanovllm.json": theirs(5000.0)})
    call(parts, "q4_mixtral_ours", "L4", {"moe_offline_mixtral-8x7b.json": ours("mixtral-8x7b", {"fixed256": 9000.0}, "c2")})
    call(parts, "q5_mixtral_vllm", "L5", {"vllm_mixtral-8x7b_fixed256.json": theirs(7500.0)})
    call(parts, "q8_ep", "L8", {"moe_offline_mixtral-8x7b_tp2.json": ours("mixtral-8x7b", {"fixed256_tp2": 8000.0}, "c2"),
                                "moe_offline_mixtral-8x7b_tp2_ep.json": ours("mixtral-8x7b", {"fixed256_tp2_ep": 10000.0},
                                                                             "c2")})
    rates = {"rates": [10, 20, 40], "fractions": [0.3, 0.6, 0.9], "saturation_req_s": 44.4}
    call(parts, "q6_online_vllm", "L6", {f"online_{q}/rates.json": rates,
                                         **{f"online_{q}/{f.name}": json.loads(f.read_text())
                                            for f in LEASE.glob("online_vllm_r*.json")}})
    call(parts, "q7_online_ours", "L6", {f"online_{q}/{f.name}": json.loads(f.read_text())
                                         for f in LEASE.glob("online_pagedserve_r*.json")})
    layer_out = tmp_path / "moe_layer.json"
    layer_out.write_text(json.dumps({"commit": "2aa153b", "ratios": {}}))
    doc = collect(parts, out, layer_out)
    r, ratios = doc["results"], doc["ratios"]

    # Same lease preferred over another lease's vLLM run.
    assert ratios[f"{q}_nanovllm_over_vllm"] == round(7000 / 6000, 3)
    assert r[f"{q}_nanovllm"]["vllm_same_lease"] is True and r[f"{q}_nanovllm"]["lease"] == "L2"
    assert ratios[f"{q}_nanovllm_decode_roofline_fraction"] == 0.81
    # The replaced run keeps its figures, with the commit it ran at.
    # (the newest entry: moe.json keeps every earlier replacement before it)
    old = doc["superseded"][f"{q}_nanovllm"][-1]
    assert len(doc["superseded"][f"{q}_nanovllm"]) == len(before.get("superseded", {}).get(f"{q}_nanovllm", [])) + 1
    assert old["results"]["runs"] == before["results"][f"{q}_nanovllm"]["runs"]
    assert old["ratios"][f"{q}_nanovllm_over_vllm"] == before["ratios"][f"{q}_nanovllm_over_vllm"]
    assert old["commit"] == before["results"][f"{q}_nanovllm"].get("commit", before["commit"])
    # Untouched: Qwen's fixed256 as it was.
    assert r[f"{q}_fixed256"] == before["results"][f"{q}_fixed256"]
    assert ratios[f"{q}_fixed256_over_vllm"] == before["ratios"][f"{q}_fixed256_over_vllm"]
    # Only another lease's vLLM: the ratio, flagged.
    assert ratios["mixtral-8x7b_fixed256_over_vllm"] == round(9000 / 7500, 3)
    assert r["mixtral-8x7b_fixed256"]["vllm_same_lease"] is False
    # Expert parallel over sharded (TP=2, one lease); neither is set against vLLM's one-GPU run.
    assert ratios["mixtral-8x7b_fixed256_tp2_ep_over_tp2"] == 1.25
    assert not any(k.startswith("mixtral-8x7b_fixed256_tp2") and k.endswith("_over_vllm") for k in ratios)
    # Online: vs_vllm's ratios over the phase files, named by the fraction of vLLM's saturation.
    phase = {e: json.loads((LEASE / f"online_{e}_r20.json").read_text())["results"] for e in ("pagedserve", "vllm")}
    assert ratios[f"{q}_sharegpt-like_at60pct_tpot_p50_over_vllm"] == round(
        phase["pagedserve"]["tpot_ms"]["p50"] / phase["vllm"]["tpot_ms"]["p50"], 3)
    assert ratios[f"{q}_sharegpt-like_at90pct_throughput_over_vllm"] == round(
        json.loads((LEASE / "online_pagedserve_r40.json").read_text())["results"]["request_throughput"]
        / json.loads((LEASE / "online_vllm_r40.json").read_text())["results"]["request_throughput"], 3)
    assert r[f"{q}_sharegpt-like"]["same_lease"] is True and r[f"{q}_sharegpt-like"]["saturation"]["saturation_req_s"] == 44.4
    assert ratios[f"{q}_layer_b1_over_vllm"] == 1.2
    assert json.loads(layer_out.read_text())["commit"] == "c1" and r["layer"]["replaced_commit"] == "2aa153b"

    again = collect(parts, out, layer_out)
    for key in ("results", "ratios", "superseded"):
        assert again[key] == doc[key]


def layer_part(commit: str, models: dict, tp: int = 1, ep: bool = False) -> dict:
    """A bench_fused_moe.py output: {model: {batch: (ours_us, vllm_us or None)}}."""
    results = {m: {"shape": {"tp": tp, "expert_parallel": ep},
                   "batches": {str(T): {"ours_us": us, "ours_timing": "graph",
                                        **({"ours_over_vllm_speed": round(vl / us, 3)} if vl else {})}
                               for T, (us, vl) in rows.items()}} for m, rows in models.items()}
    ratios = {f"{m}_layer_b{T}_over_vllm": row["ours_over_vllm_speed"]
              for m, r in results.items() for T, row in r["batches"].items() if "ours_over_vllm_speed" in row}
    return {"commit": commit, "results": {**results, "copy_bandwidth_GBps": 4300.0}, "ratios": ratios}


def test_layer_parts_merge_per_model_and_ep_over_sharded(tmp_path):
    """A retune of one model times only that one: the other model's layer figures stay from the
    older part, in moe.json and in the merged moe_layer.json; ep_layer's two files give EP over sharded."""
    q, m = "qwen3-30b-a3b", "mixtral-8x7b"
    parts = tmp_path / "parts"
    call(parts, "a_both", "L1", {"moe_layer.json": layer_part("c1", {q: {1: (20.0, 25.0)}, m: {1: (200.0, 180.0)}})})
    call(parts, "b_mixtral", "L2", {"moe_layer.json": layer_part("c2", {m: {1: (190.0, 190.0)}})})
    call(parts, "c_ep", "L3", {"moe_layer_tp2.json": layer_part("c3", {m: {64: (500.0, None), 128: (540.0, None)}}, 2),
                               "moe_layer_tp2_ep.json": layer_part("c3", {m: {64: (600.0, None), 128: (540.0, None)}},
                                                                   2, True)})
    out, layer_out = tmp_path / "moe.json", tmp_path / "moe_layer.json"
    doc = collect(parts, out, layer_out)
    ratios = doc["ratios"]
    assert ratios[f"{q}_layer_b1_over_vllm"] == 1.25  # from the older part: the newer one lacks Qwen
    assert ratios[f"{m}_layer_b1_over_vllm"] == 1.0  # the newer part's
    assert doc["results"]["layer"]["models"][q]["commit"] == "c1"
    assert doc["results"]["layer"]["models"][m]["lease"] == "L2"
    merged = json.loads(layer_out.read_text())
    assert merged["results"][q]["commit"] == "c1" and merged["results"][m]["batches"]["1"]["ours_us"] == 190.0
    assert merged["ratios"] == {f"{q}_layer_b1_over_vllm": 1.25, f"{m}_layer_b1_over_vllm": 1.0}
    assert ratios[f"{m}_layer_b64_tp2_ep_over_tp2"] == round(500 / 600, 3)
    assert ratios[f"{m}_layer_b128_tp2_ep_over_tp2"] == 1.0
    assert doc["results"]["layer_tp2"]["lease"] == "L3"
    assert not any(k.startswith(q) and "tp2" in k for k in ratios)  # Qwen was not in the ep_layer call
    again = collect(parts, out, layer_out)
    assert again["ratios"] == ratios and json.loads(layer_out.read_text()) == merged


def test_two_pairs_in_one_lease_each_keep_their_own_vllm_run(tmp_path):
    m = "mixtral-8x7b"
    parts = tmp_path / "parts"
    call(parts, "a_pair", "L1", {f"moe_offline_{m}.json": ours(m, {"nanovllm": 3762.0}, "c1"),
                                 f"vllm_{m}_nanovllm.json": theirs(3620.0)})
    call(parts, "b_pair", "L1", {f"moe_offline_{m}.json": ours(m, {"nanovllm": 3764.0}, "c1"),
                                 f"vllm_{m}_nanovllm.json": theirs(3600.0)})
    doc = collect(parts, tmp_path / "moe.json")
    assert doc["ratios"][f"{m}_nanovllm_over_vllm"] == round(3764 / 3600, 3)
    first = doc["superseded"][f"{m}_nanovllm"]
    assert len(first) == 1 and first[0]["ratios"][f"{m}_nanovllm_over_vllm"] == round(3762 / 3620, 3)
    assert collect(parts, tmp_path / "moe.json")["superseded"] == doc["superseded"]  # collecting again adds nothing
