"""Merge the parts of the MoE device calls (benchmarks/moe_run.sh, one $OUT per call, copied under
--parts, e.g. benchmarks/results/h200/moe_parts/<call>/) into moe.json. CPU is fine.

    python benchmarks/offline/moe_collect.py --parts benchmarks/results/h200/moe_parts \
        --output benchmarks/results/h200/moe.json

What each call's folder may hold, and where it goes:
- lease.txt (moe_run.sh: "<lease id> new|continued"): which machine lease the call ran in. Calls
  that share an id ran on one machine, one after the other, without it being handed back.
- moe_offline_<model>.json (moe_offline.py --one-engine): ours, offline. Each run replaces the
  result of the same name in moe.json; the replaced one moves to the list `superseded[name]` with
  its commit and ratios (nothing measured is dropped; collecting the same parts again changes nothing). Its ratios (<name>_roofline_fraction,
  <name>_decode_roofline_fraction) replace the old ones.
- vllm_<model>_<workload>.json (bench_vllm.py --tag <model>): vLLM's run of the same workload. The
  ratio <model>_<workload>_over_vllm pairs ours with the vLLM part of the SAME lease when there
  is one (else another lease's, and `vllm_same_lease: false` says so), run for run as
  moe_offline.like_for_like does.
- online_<model>/ (vs_vllm.py online --work): both engines' sharegpt-like runs, maybe from two calls;
  vs_vllm.py collect computes their ratios, which land here as
  <model>_sharegpt-like_<at30pct|rX>_<tpot_p50|ttft_p99|throughput>_over_vllm (atNpct where
  rates.json says which fraction of vLLM's saturation the rate was).
- moe_offline_<model>_tp2.json, moe_offline_<model>_tp2_ep.json (moe_run.sh ep): results
  <model>_<workload>_tp2[_ep], and <model>_<workload>_tp2_ep_over_tp2 where both ran in one lease.
- moe_layer.json (bench_fused_moe.py --vllm): its <model>_layer_b<T>_over_vllm ratios, each model's
  from the newest part that timed it, a pointer, and those parts merged over --layer-output
  (benchmarks/results/h200/moe_layer.json; the newest part as written when it has every model).
- moe_layer_tp2.json + moe_layer_tp2_ep.json (moe_run.sh ep_layer, one call): one rank's share of the
  layer at TP=2, <model>_layer_b<T>_tp2_ep_over_tp2 (sharded time / expert-parallel time).
Results in moe.json that no part replaces stay as they are.
"""
from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(Path(__file__).resolve().parent))
from moe_offline import like_for_like, vllm_runs  # noqa: E402


NOTE = "each result carries its own commit and lease (results.*.commit, .lease); replaced runs are under superseded"


def load(path: Path) -> dict:
    return json.loads(path.read_text())


def call_dir(parts: Path, f: Path) -> Path:
    return parts / f.relative_to(parts).parts[0]


def lease_of(parts: Path, f: Path) -> str:
    """The lease id of the call that wrote f (its call folder's lease.txt), else the folder's name."""
    txt = call_dir(parts, f) / "lease.txt"
    return txt.read_text().split()[0] if txt.is_file() and txt.read_text().split() else call_dir(parts, f).name


def supersede(doc: dict, name: str, source) -> None:
    """Move results[name] and its ratios to the list superseded[name], with the commit they were
    measured at; a result from the same source (collect run again over the same parts) just goes."""
    old = doc["results"].pop(name, None)
    longer = [n for n in doc["results"] if n.startswith(name + "_")]  # e.g. <name>_tp2: its ratios are its own
    ratios = {k: doc["ratios"].pop(k) for k in list(doc["ratios"])
              if (k == name or k.startswith(name + "_")) and not any(k.startswith(n + "_") for n in longer)}
    if old is None or old.get("source") == source:
        return
    # A run merged before results carried commits: the file's commit (moe.json's of 811b171 was corrected
    # by hand there, while config.merged_runs kept the stale .git's 315c8fc; see its commit_note).
    commit = old.get("commit") or doc.get("commit")
    kept, src = doc.setdefault("superseded", {}).setdefault(name, []), old.get("source")
    if src is None or all(e["results"].get("source") != src for e in kept):  # listed once, however often collected
        kept.append({"commit": commit, "results": old, "ratios": ratios})


def drop_live_from_superseded(doc: dict) -> None:
    """Collecting again walks the parts from the oldest, so a live result is superseded on the way
    before it wins again: it does not stay listed as replaced."""
    for name, kept in doc.get("superseded", {}).items():
        live = doc["results"].get(name, {}).get("source") if isinstance(kept, list) else None
        if live is not None:
            kept[:] = [e for e in kept if e["results"].get("source") != live]


def merge_offline(doc: dict, parts: Path) -> list[str]:
    merged = []
    vllm_parts = sorted(parts.glob("*/vllm_*.json"))
    for f in sorted(parts.glob("*/moe_offline_*.json")):
        part, lease = load(f), lease_of(parts, f)
        for name, res in part["results"].items():
            if name == "errors":
                doc.setdefault("part_errors", {})[f.relative_to(parts).as_posix()] = res
                continue
            source = f.relative_to(parts).as_posix()
            supersede(doc, name, source)
            doc["results"][name] = {**res, "commit": part.get("commit"), "lease": lease, "source": source}
            doc["ratios"].update({k: v for k, v in part.get("ratios", {}).items() if k.startswith(name + "_")})
            doc.setdefault("config", {}).setdefault("merged_runs", {})[name] = part.get("commit")
            # Tagged runs (tp2, tp2_ep: two GPUs) are not set against vLLM's one-GPU run; see ep_ratios.
            theirs = [v for v in vllm_parts if v.name == f"vllm_{name}.json"]
            same = [v for v in theirs if lease_of(parts, v) == lease]
            beside = [v for v in same if v.parent == f.parent]  # a lease with several pairs: this call's own
            pick = (beside or same or theirs)[-1:] if theirs else []
            for v in pick:
                pair = like_for_like(doc["results"][name], vllm_runs(v))
                if pair:
                    ours, their, which = pair
                    doc["results"][name].update(vllm_output_tokens_per_s=their, compared_output_tokens_per_s=ours,
                                                vllm_comparison=which, vllm_lease=lease_of(parts, v),
                                                vllm_same_lease=bool(same), vllm_source=v.relative_to(parts).as_posix())
                    doc["ratios"][f"{name}_over_vllm"] = round(ours / their, 3)
            merged.append(name)
        doc["switches"] = part.get("switches", doc.get("switches"))
    return merged


def ep_ratios(doc: dict) -> None:
    """<model>_<workload>_tp2_ep_over_tp2: expert parallelism's output tokens/s over sharding's (TP=2
    both, cold runs), where both are in moe.json and ran in one lease."""
    r = doc["results"]
    for name, ep in r.items():
        base = name.removesuffix("_tp2_ep")
        if name == base or f"{base}_tp2" not in r or not isinstance(ep, dict):
            continue
        sharded = r[f"{base}_tp2"]
        if ep.get("lease") != sharded.get("lease") or "runs" not in ep or "runs" not in sharded:
            continue
        doc["ratios"][f"{name}_over_tp2"] = round(ep["runs"][0]["output_tokens_per_s"]
                                                  / sharded["runs"][0]["output_tokens_per_s"], 3)


def merge_online(doc: dict, parts: Path) -> list[str]:
    merged = []
    by_model: dict[str, list[Path]] = {}
    for d in sorted(parts.glob("*/online_*")):
        if d.is_dir():
            by_model.setdefault(d.name.removeprefix("online_"), []).append(d)
    for model, dirs in by_model.items():
        work = Path(tempfile.mkdtemp())
        leases = {}
        for d in dirs:  # later calls' files win (a rerun of one engine)
            for f in d.glob("*.json"):
                (work / f.name).write_text(f.read_text())
                for engine in ("vllm", "pagedserve"):
                    if f.name.startswith(f"online_{engine}_"):
                        leases[engine] = lease_of(parts, f)
        rates_file = work / "rates.json"
        rates = load(rates_file)["rates"] if rates_file.is_file() else sorted(
            {float(f.stem.rsplit("_r", 1)[1]) for f in work.glob("online_*_r*.json")})
        if not rates:
            continue
        out = work / "collected.json"
        cmd = [sys.executable, str(ROOT / "benchmarks/serving/vs_vllm.py"), "collect", "--work", str(work),
               "--model", str(ROOT / "benchmarks/models" / model), "--rates", *map(str, rates),
               "--device", doc.get("device") or "NVIDIA H200", "--gpus", "0", "--output", str(out)]
        subprocess.run(cmd, check=True, capture_output=True, text=True, cwd=ROOT)
        got = load(out)
        name = f"{model}_sharegpt-like"
        source = [d.relative_to(parts).as_posix() for d in dirs]
        supersede(doc, name, source)
        fractions = load(rates_file)["fractions"] if rates_file.is_file() else None
        labels = {f"r{r:g}": (f"at{round(100 * f)}pct" if fractions else f"r{r:g}")
                  for r, f in zip(rates, fractions or rates)}
        doc["results"][name] = {"online": got["results"]["online"], "saturation": got["results"].get("saturation"),
                                "rates": {labels[k]: float(k[1:]) for k in labels}, "commit": got.get("commit"),
                                "leases": leases, "same_lease": len(set(leases.values())) == 1 and len(leases) == 2,
                                "config": got.get("config"), "source": source}
        for key, value in got["ratios"].items():  # tpot_p50_over_vllm_r6.1 -> <name>_at30pct_tpot_p50_over_vllm
            what, _, rate = key.rpartition("_over_vllm_")
            if what and rate in labels:
                doc["ratios"][f"{name}_{labels[rate]}_{what}_over_vllm"] = value
        merged.append(name)
    return merged


def layer_models(layer: dict) -> list[str]:
    return [m for m, v in layer.get("results", {}).items() if isinstance(v, dict) and "batches" in v]


def merge_layer(doc: dict, parts: Path, layer_output: Path | None = None) -> list[str]:
    """Each model's layer figures from the newest part that timed it (a retune of one model times only
    that one) into moe.json's ratios; with layer_output, those parts merged over that file, each
    model's results with the commit and part they came from (the predecessor's commit is kept beside
    the pointer; git keeps its figures)."""
    files = sorted(parts.glob("*/moe_layer.json"))
    if not files:
        return []
    newest: dict[str, Path] = {}
    for f in files:
        for m in layer_models(load(f)) or ["*"]:  # a part without per-model results: all of it
            newest[m] = f
    base = load(files[-1])
    merged = {**base, "results": dict(base.get("results", {})), "ratios": {}}
    sources = {}
    for m, f in newest.items():
        layer = load(f)
        if m != "*":
            merged["results"][m] = {**layer["results"][m], "commit": layer.get("commit"),
                                    "source": f.relative_to(parts).as_posix()}
        merged["ratios"].update({k: v for k, v in layer.get("ratios", {}).items()
                                 if "_layer_b" in k and (m == "*" or k.startswith(m + "_"))})
        sources[m] = {"commit": layer.get("commit"), "lease": lease_of(parts, f),
                      "source": f.relative_to(parts).as_posix()}
    text = json.dumps(merged, indent=2) + "\n"
    if len({s["source"] for s in sources.values()}) == 1:  # one part has every model: that part, as written
        merged, text = base, files[-1].read_text()
    replaced = None
    if layer_output is not None:
        if layer_output.is_file() and load(layer_output) != merged:
            replaced = load(layer_output).get("commit")
        layer_output.write_text(text)
    for k in [k for k in doc["ratios"] if "_layer_b" in k and "_tp2" not in k]:
        doc["ratios"].pop(k)
    doc["ratios"].update({k: v for k, v in merged.get("ratios", {}).items() if "_layer_b" in k})
    previous = doc["results"].get("layer", {})
    doc["results"]["layer"] = {"models": sources, "file": "benchmarks/results/h200/moe_layer.json",
                               "replaced_commit": replaced or previous.get("replaced_commit")}
    return ["layer"]


def merge_layer_ep(doc: dict, parts: Path) -> list[str]:
    """One rank's share of the layer at TP=2 (moe_run.sh ep_layer: moe_layer_tp2.json, sharded, and
    moe_layer_tp2_ep.json, whole experts, one call): <model>_layer_b<T>_tp2_ep_over_tp2, expert
    parallelism's speed over sharding's (sharded time / EP time), from the newest call with both."""
    calls = [f.parent for f in sorted(parts.glob("*/moe_layer_tp2_ep.json")) if (f.parent / "moe_layer_tp2.json").is_file()]
    if not calls:
        return []
    d = calls[-1]
    sharded, ep = load(d / "moe_layer_tp2.json"), load(d / "moe_layer_tp2_ep.json")
    for k in [k for k in doc["ratios"] if "_layer_b" in k and k.endswith("_tp2_ep_over_tp2")]:
        doc["ratios"].pop(k)
    models = sorted(set(layer_models(sharded)) & set(layer_models(ep)))
    for m in models:
        for T, row in ep["results"][m]["batches"].items():
            base = sharded["results"][m]["batches"].get(T)
            if base and row.get("ours_timing") == base.get("ours_timing"):
                doc["ratios"][f"{m}_layer_b{T}_tp2_ep_over_tp2"] = round(base["ours_us"] / row["ours_us"], 3)
    doc["results"]["layer_tp2"] = {"commit": ep.get("commit"), "lease": lease_of(parts, d / "lease.txt"),
                                   "source": [(d / n).relative_to(parts).as_posix()
                                              for n in ("moe_layer_tp2.json", "moe_layer_tp2_ep.json")],
                                   "shapes": {m: {"tp2": sharded["results"][m]["shape"], "tp2_ep": ep["results"][m]["shape"]}
                                              for m in models}}
    return ["layer_tp2"]


def collect(parts: Path, output: Path, layer_output: Path | None = None) -> dict:
    doc = load(output) if output.is_file() else {"benchmark": "moe", "results": {}, "ratios": {}, "config": {}}
    doc.setdefault("results", {})
    doc.setdefault("ratios", {})
    merged = (merge_offline(doc, parts) + merge_online(doc, parts) + merge_layer(doc, parts, layer_output)
              + merge_layer_ep(doc, parts))
    ep_ratios(doc)
    drop_live_from_superseded(doc)
    if merged:
        commits = {r.get("commit") for n, r in doc["results"].items() if n in merged and isinstance(r, dict)} - {None}
        if doc.get("commit_note", NOTE) != NOTE:  # it described the runs it came with; they may be superseded now
            doc.setdefault("superseded", {})["commit_note"] = doc.pop("commit_note")
        if len(commits) == 1:
            doc["commit"] = commits.pop()
        doc["commit_note"] = NOTE
        doc["collected_by"] = "python benchmarks/offline/moe_collect.py " + shlex.join(sys.argv[1:])
        doc["collected"] = merged
    output.write_text(json.dumps(doc, indent=2) + "\n")
    return doc


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--parts", default=str(ROOT / "benchmarks/results/h200/moe_parts"))
    ap.add_argument("--output", default=str(ROOT / "benchmarks/results/h200/moe.json"))
    ap.add_argument("--layer-output", default=str(ROOT / "benchmarks/results/h200/moe_layer.json"),
                    help="where the newest part's moe_layer.json goes ('' : leave it)")
    args = ap.parse_args()
    doc = collect(Path(args.parts), Path(args.output), Path(args.layer_output) if args.layer_output else None)
    print(json.dumps({"collected": doc.get("collected", []), "ratios": doc["ratios"]}, indent=2))


if __name__ == "__main__":
    main()
