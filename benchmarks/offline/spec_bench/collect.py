"""collect: the part files (one a section, benchmarks/results/h200/spec_decode_parts/) -> one result
(benchmarks/results/h200/spec_decode.json) with the ratios and the issue's targets.

Invariants: every part of ours ran the same code, device, set-up and weights (else collect refuses:
off against spec would compare two models); a ratio against vLLM is made only from a vLLM part that
ran the same checkpoint as ours (equal weights records, weights.weights_record); dummy weights never
match across engines (each fills them its own way), so a dummy vLLM part is listed, not compared.
"""
from __future__ import annotations

import json
from pathlib import Path

# What a part written before parts recorded their weights ran: every section then used dummy weights.
UNRECORDED = {"load_format": "dummy", "recorded": False}


def merge_parts(parts_dir: Path) -> tuple[dict, set]:
    """{"ours": {"bB": {run: ...}}, "vllm": {config: {"bB": {...}}}, "setup", "host", "weights": {part:
    its weights record}} from the part files, and their (device, commit) stamps (vLLM parts carry
    commit "vllm")."""
    merged: dict = {"ours": {}, "vllm": {}, "setup": {}, "host": {}, "weights": {}}
    stamps = set()
    for f in sorted(parts_dir.glob("*.json")):
        doc = json.loads(f.read_text())
        stamps.add((doc["device"], doc["commit"]))
        merged["setup"][f.stem] = doc.get("setup")
        merged["host"][f.stem] = doc.get("host")
        merged["weights"][f.stem] = doc.get("weights") or UNRECORDED
        if f.stem.startswith("vllm_"):
            merged["vllm"][f.stem[len("vllm_"):]] = doc["results"]
        else:
            for key, runs in doc["results"].items():
                if key.startswith("b") and isinstance(runs, dict):
                    merged["ours"].setdefault(key, {}).update(runs)
                else:
                    merged["ours"].setdefault("engine_seconds", {})[f.stem] = runs
    return merged, stamps


# A TPOT is (t(full) - t(two tokens)) / (n - 2): a one-off (a compile, a lazy allocation) inside the
# timed two-token generate inflates t(two tokens) and makes the TPOT too small. The untimed warm-up is
# the same two-token generate run just before, so a two-token time this far above it marks the run
# unsteady and it gives no ratio (vLLM's draft run at batch 32 on the H200: 0.70 s against a 0.45 s
# warm-up, a TPOT of 6.1 ms between its 11.0 at batch 8 and 18.8 at 128).
UNSTEADY_TWO_TOKEN_OVER_WARMUP = 1.25


def unsteady(r: dict) -> bool:
    w, t2 = r.get("warmup_seconds"), r.get("two_token_seconds")
    return bool(w and t2 and t2 > UNSTEADY_TWO_TOKEN_OVER_WARMUP * w)


def _tpot(section: dict, batch: int, run: str | None = None) -> float | None:
    r = section.get(f"b{batch}")
    if r is not None and run is not None:
        r = r.get(run)
    return None if r is None or unsteady(r) else r.get("tpot_ms")


def unsteady_runs(merged: dict) -> list[str]:
    """Every run that gives no ratio because its two-token generate ran far above its warm-up:
    ours is {"b1": {run: figures}}, vLLM's {config: {"b1": figures}}."""
    ours = [f"ours b{b} {run}" for b in _batches(merged["ours"])
            for run, r in merged["ours"][f"b{b}"].items() if unsteady(r)]
    theirs = [f"vllm {config} b{b}" for config, sec in sorted(merged["vllm"].items())
              for b in _batches(sec) if unsteady(sec[f"b{b}"])]
    return ours + theirs


def _batches(section: dict) -> list[int]:
    return sorted(int(k[1:]) for k in section if k[:1] == "b" and k[1:].isdigit())


def _ratio(x: float | None, y: float | None) -> float | None:
    # A TPOT at or below 0 (a run too short to time: only on the CPU smoke) gives no ratio.
    return round(x / y, 3) if x is not None and y is not None and x > 0 and y > 0 else None


def ratios_of(merged: dict, batches, ks, vllm_configs=None) -> dict:
    """Our ratios, and against vLLM those of vllm_configs (default every vLLM part: collect passes
    only the ones that ran our weights)."""
    ours = merged["ours"]
    theirs = {c: r for c, r in merged["vllm"].items() if vllm_configs is None or c in vllm_configs}
    off = {b: _tpot(ours, b, "off") for b in batches}
    r = {"tpot_b1_k4_a100_over_off": _ratio(_tpot(ours, 1, "k4_replay_a1"), off.get(1)),
         "tpot_b1_k4_a100_draft_over_off": _ratio(_tpot(ours, 1, "k4_draft_a1"), off.get(1))}
    for b in batches:
        r[f"adaptive_over_off_b{b}"] = _ratio(_tpot(ours, b, "adaptive_ngram"), off[b])
        r[f"adaptive_draft_over_off_b{b}"] = _ratio(_tpot(ours, b, "adaptive_draft"), off[b])
        for name in ("adaptive_draft_a0", "adaptive_replay_a0", "adaptive_empty"):
            r[f"{name}_over_off_b{b}"] = _ratio(_tpot(ours, b, name), off[b])
    # Only the vLLM configs that ran (the quick plan runs off, draft_model_k4 and ngram_k4), each
    # against our run of the same set-up: off, kK_draft_a1 (draft = target), kK_ngram.
    for config in sorted(theirs):
        method, _, k = config.rpartition("_k")
        mine = {"off": "off", "draft_model": f"k{k}_draft_a1", "ngram": f"k{k}_ngram"}.get(method or config)
        if mine is None:
            continue
        label = "off" if mine == "off" else f"{method.split('_')[0]}_k{k}"
        for b in batches:
            r[f"tpot_{label}_b{b}_over_vllm"] = _ratio(_tpot(ours, b, mine), _tpot(theirs[config], b))
    return r


def targets_of(ratios: dict, batches) -> dict:
    """The issue's H200 targets against the collected ratios: {target: {"value", "limit", "met"}}
    (met None where a figure is missing). The adaptive target takes the worst ratio over batches and
    over the n-gram, draft and every-proposal-rejected runs; the vLLM target the worst of the matching
    set-ups (draft = target and n-gram, every k and batch that ran)."""
    def target(values: list, limit: float) -> dict:
        got = [v for v in values if v is not None]
        worst = max(got) if got else None
        return {"value": worst, "limit": limit,
                "met": None if worst is None or len(got) < len(values) else worst <= limit}

    adaptive = [ratios.get(f"{n}_over_off_b{b}") for b in batches
                for n in ("adaptive", "adaptive_draft", "adaptive_draft_a0", "adaptive_replay_a0", "adaptive_empty")]
    vs_vllm = [v for n, v in ratios.items() if n.endswith("_over_vllm") and not n.startswith("tpot_off_")]
    return {"b1_k4_a100_replay_tpot_over_off": target([ratios.get("tpot_b1_k4_a100_over_off")], 0.4),
            "b1_k4_a100_draft_tpot_over_off": target([ratios.get("tpot_b1_k4_a100_draft_over_off")], 0.4),
            "adaptive_tpot_over_off_worst": target(adaptive, 1.02),
            "tpot_over_vllm_worst": target(vs_vllm, 1.0) if vs_vllm else {"value": None, "limit": 1.0, "met": None}}


NOTES = {
    "tpot_b1_k4_a100_over_off": "replay proposer (the target's own greedy output, free to propose), k = 4, a = 1, "
                                "batch 1: what verifying 4 proposals per step gains when all are accepted",
    "tpot_b1_k4_a100_draft_over_off": "the same with the draft model = target: each proposal costs a forward of a "
                                      "target-sized draft, so this cannot go far below 1 however cheap verification "
                                      "is; a real, smaller draft sits between the two ratios",
    "adaptive_over_off_bB": "n-gram proposer, default adaptive policy (k = 4, spec_disable_batch_tokens at its "
                            "default) against speculation off; adaptive_draft_over_off_bB: the same with the draft "
                            "model = target",
    "adaptive_draft_a0_over_off_bB": "the default adaptive policy with every proposal rejected (draft = target, "
                                     "or replay, corrupted at a = 0): yield pausing keeps most steps plain and "
                                     "overlapped, so this should stay near 1 (k4_draft_a0 is the same without it)",
    "adaptive_empty_over_off_bB": "the default adaptive policy with a proposer that never has anything (an n-gram "
                                  "over text that does not repeat): the policy's empty-step pause should keep "
                                  "this near 1",
    "acceptance": "runs *_aA corrupt each proposal with probability 1 - A (spec_decode/synthetic.py); "
                  "acceptance_rate is what the engine's counters measured. At A = 1 with the draft model = target "
                  "it is below 1 in bf16: the draft's one-token decode and the target's k + 1-token verify round "
                  "differently, which flips near-tied argmaxes (random weights have many)",
    "weights": "config.weights: the checkpoint both engines loaded (spec_bench/weights.py); a ratio to vLLM is made "
               "only from vLLM parts of the same checkpoint (config.vllm_compared)",
}


def weights_of(merged: dict) -> tuple[dict | None, dict]:
    """Our parts' one weights record (None without parts of ours; SystemExit if they differ) and, for
    each vLLM config that is not set against ours, why (module docstring)."""
    records = merged["weights"]
    mine = [w for name, w in sorted(records.items()) if not name.startswith("vllm_")]
    if any(w != mine[0] for w in mine):
        raise SystemExit("our parts ran different weights: re-run them on one checkpoint "
                         + json.dumps({n: w for n, w in records.items() if not n.startswith("vllm_")}))
    ours = mine[0] if mine else None
    skipped = {}
    for config in merged["vllm"]:
        theirs = records[f"vllm_{config}"]
        if ours is None:
            skipped[config] = "no part of ours"
        elif theirs.get("load_format") == "dummy" or ours.get("load_format") == "dummy":
            skipped[config] = ("dummy weights (each engine fills them its own way): re-run both sides with "
                               "--weights on one checkpoint")
        elif theirs != ours:
            skipped[config] = f"another checkpoint than ours: {theirs}"
    return ours, skipped


def collect(parts_dir: Path, output: Path, batches, ks, device: str | None = None) -> dict:
    from pagedserve.benchmark.results import write_result

    merged, stamps = merge_parts(parts_dir)
    ours_commits = {c for _, c in stamps if c != "vllm"}
    devices = {d for d, _ in stamps}
    if len(devices) > 1 or len(ours_commits) > 1:
        raise SystemExit(f"the parts come from several devices or commits {sorted(stamps)}: re-run them at one")
    weights, not_compared = weights_of(merged)
    compared = sorted(c for c in merged["vllm"] if c not in not_compared)
    ratios = ratios_of(merged, batches, ks, compared)
    setups = [v for v in merged["setup"].values() if v]
    if any(s_[key] != setups[0][key] for s_ in setups for key in ("model", "prompt_len", "output_len")):
        raise SystemExit(f"the parts ran different set-ups: {merged['setup']}")
    first = setups[0] if setups else {}
    # Which grid (spec_plan) each of our spec parts ran: "quick" or "full".
    grids = {name: setup.get("grid", "full") for name, setup in merged["setup"].items()
             if setup and name.startswith("ours_spec")}
    config = {"model": first.get("model"), "load_format": (weights or UNRECORDED)["load_format"],
              "weights": weights, "prompt_len": first.get("prompt_len"),
              "output_len": first.get("output_len"), "batches": list(batches),
              "ks": list(ks), "grids": grids, "vllm_configs": sorted(merged["vllm"]),
              "vllm_compared": compared, "vllm_not_compared": not_compared,
              "unsteady_runs": unsteady_runs(merged),
              "greedy": True, "ignore_eos": True, "prefix_caching": False,
              "tpot": "(t(full generate) - t(generate with max_tokens=2)) / (output_len - 2), each batch after "
                      "an untimed warm-up generate of the same batch (parts without warmup_seconds had none)"}
    if compared:
        baseline = "0.26 offline, same prompts, lengths and checkpoint (configs: " + ", ".join(compared) + ")"
    elif merged["vllm"]:
        baseline = "ran, not compared (config.vllm_not_compared says why)"
    else:
        baseline = "not run (no vllm_* parts)"
    hosts = [h for name, h in sorted(merged.pop("host").items()) if h and not name.startswith("vllm_")]
    targets = targets_of(ratios, batches)
    write_result(output, "spec_decode", None, config, merged, {"vllm": baseline}, ratios,
                 device=device or (devices.pop() if devices else None), host=hosts[0] if hosts else None,
                 measured_commit=ours_commits.pop() if ours_commits else None,
                 extra={"targets": targets, "notes": NOTES})
    return {"ratios": ratios, "targets": targets, "vllm_not_compared": not_compared}
