"""FP8 on the H200: Llama-3.1-8B (dummy weights) with --quantization fp8 --kv-cache-dtype fp8.

Sections, each one process (one device command of < 10 min each; docs/fp8.md lists them):
  trtllm SHAPE   offline output tok/s at TensorRT-LLM's published shapes (128/128, 128/2048) beside its
                 published Llama-3.1-8B FP8 H200 figures (27,911 and 26,221 output tok/s);
  capacity KV    the largest batch of 4k-token sequences (3840 prompt + 256 output) that fits the pool
                 with KV dtype KV (auto = bf16, or fp8), run once at that batch to check it never preempts;
                 the output is long enough that the first sequences still run when the last are admitted
                 (with 16 output tokens, the 12-1 lease's runs, at most a third were ever co-resident), and
                 peak_block_fraction says how full the pool got;
  collect        merges the section files and `pagedserve bench throughput` results (fixed256, nanovllm
                 with the FP8 switches) in --parts into benchmarks/results/h200/fp8.json; it reads JSON
                 only, so it runs anywhere; every result keeps the commit it ran at (leases are short:
                 parts of one file come from several), and parts of different devices are refused.
vLLM 0.26 with the same switches (quantization="fp8", kv_cache_dtype="fp8") runs from a site dir where
it is installed: benchmarks/serving/peers/bench_vllm.py --workload fixed256 --also trtllm_128_128
--quantization fp8 --kv-cache-dtype fp8 --tag fp8 writes vllm_fp8_<workload>.json; put them in --parts
and collect adds fixed256_over_vllm_fp8 and <shape>_over_vllm_fp8 (run for run: our first fixed256
run, like vLLM's single one, has a cold prefix cache; our second repeats the prompts and hits it).
"""
from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from pagedserve.benchmark.results import engine_switches, git_commit, write_result  # noqa: E402

MODEL = str(ROOT / "benchmarks/models/llama-3.1-8b")
FP8 = {"quantization": "fp8", "kv_cache_dtype": "fp8"}
TRTLLM_PUBLISHED = {"128_128": 27911.0, "128_2048": 26221.0}  # output tok/s, Llama-3.1-8B FP8, one H200
SHAPES = {"128_128": (128, 128, 8000), "128_2048": (128, 2048, 1000)}  # prompt, output, requests
CAPACITY_PROMPT, CAPACITY_OUTPUT = 3840, 256


def _requests(prompt_len: int, output_len: int, n: int, seed: int = 0):
    from pagedserve.workloads import WorkloadRequest
    rng = random.Random(seed)
    return [WorkloadRequest([rng.randrange(10000) for _ in range(prompt_len)], output_len) for _ in range(n)]


def _stamp() -> dict:
    """Where and how a part ran: called after the run, so the switches include the kernels it picked."""
    import torch
    return {"device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu", "commit": git_commit(),
            "switches": engine_switches()}


def _llm(**kw):
    from pagedserve import LLM
    return LLM(MODEL, load_format="dummy", skip_tokenizer_init=True, max_model_len=4096, **kw)


def trtllm(shape: str, out: Path) -> dict:
    from pagedserve.benchmark.throughput import timed_generate, warm_up_requests
    prompt, output, n = SHAPES[shape]
    reqs = _requests(prompt, output, n)
    llm = _llm(**FP8)
    timed_generate(llm, warm_up_requests(reqs[:1024]))
    run = timed_generate(llm, reqs)
    stats = llm.get_kv_cache_stats()
    res = {"shape": shape, "num_requests": n, "prompt_len": prompt, "output_len": output,
           "seconds": round(run.seconds, 3), "output_tokens_per_s": round(run.output_tokens_per_s, 1),
           "num_gpu_blocks": stats.num_blocks_total, "cache_dtype": stats.cache_dtype,
           "num_preemptions": stats.num_preemptions, "trtllm_published_output_tokens_per_s": TRTLLM_PUBLISHED[shape],
           "over_trtllm_published": round(run.output_tokens_per_s / TRTLLM_PUBLISHED[shape], 3), **_stamp()}
    (out / f"trtllm_{shape}.json").write_text(json.dumps(res, indent=2))
    return res


def capacity(kv: str, out: Path) -> dict:
    from pagedserve import SamplingParams
    # Sizing only: the same profile (max_num_batched_tokens tokens) as the run below, no graphs to capture.
    blocks_llm = _llm(kv_cache_dtype=kv, enforce_eager=True)
    stats = blocks_llm.get_kv_cache_stats()
    per_seq = -(-(CAPACITY_PROMPT + CAPACITY_OUTPUT) // stats.block_size)
    fits = stats.num_blocks_total // per_seq
    blocks_llm.shutdown()
    del blocks_llm
    import gc
    import torch
    gc.collect()
    torch.cuda.empty_cache()
    llm = _llm(kv_cache_dtype=kv, max_num_seqs=fits, enable_prefix_caching=False)
    reqs = _requests(CAPACITY_PROMPT, CAPACITY_OUTPUT, fits, seed=1)
    params = SamplingParams(temperature=0.0, max_tokens=CAPACITY_OUTPUT, ignore_eos=True)
    t0 = time.perf_counter()
    llm.generate([{"prompt_token_ids": r.prompt_token_ids} for r in reqs], params, use_tqdm=False)
    secs = time.perf_counter() - t0
    s = llm.get_kv_cache_stats()
    res = {"kv_cache_dtype": s.cache_dtype, "num_gpu_blocks": s.num_blocks_total, "block_size": s.block_size,
           "sequence_tokens": CAPACITY_PROMPT + CAPACITY_OUTPUT, "largest_batch": fits,
           "peak_blocks_used": s.peak_blocks_used, "peak_block_fraction": round(s.peak_blocks_used / s.num_blocks_total, 3),
           "num_preemptions": s.num_preemptions, "seconds": round(secs, 2),
           **_stamp()}
    (out / f"capacity_{kv}.json").write_text(json.dumps(res, indent=2))
    return res


def _vllm_output_tok_s(path: Path, model: str | None = None) -> float | None:
    """vLLM's output tok/s from a bench_vllm.py file, or None when there is none or it ran another
    model than ours (`model`: our model dir; bench_vllm's nanovllm defaults to Qwen3-0.6B)."""
    if not path.exists():
        return None
    doc = json.loads(path.read_text())
    theirs = Path(doc["config"].get("model_config") or "").parent.name
    if model is not None and theirs != Path(model).name:
        print(f"{path.name}: vLLM ran {theirs}, ours {Path(model).name}: no ratio", file=sys.stderr)
        return None
    return doc["results"]["output_tok_s"]


def collect(parts: Path, output: Path, note: str | None = None) -> None:
    results, ratios, stamps = {}, {}, []
    for name in ("fixed256", "nanovllm"):
        f = parts / f"{name}_fp8.json"
        if f.exists():
            doc = json.loads(f.read_text())
            stamps.append({"device": doc["device"], "commit": doc["commit"]})
            results[name] = {k: doc["results"][k] for k in ("output_tokens_per_s", "total_tokens_per_s",
                                                              "requests_per_s", "seconds", "num_gpu_blocks")}
            results[name].update(command=doc["command"], commit=doc["commit"])
            ratios[f"{name}_over_vllm_fp8"] = None
            theirs = _vllm_output_tok_s(parts / f"vllm_fp8_{name}.json", doc["config"]["model"])
            if theirs:
                cold = doc["results"]["runs"][0]["output_tokens_per_s"]  # like vLLM's one run: no cache hits
                results[name].update(first_run_output_tokens_per_s=cold, vllm_fp8_output_tokens_per_s=theirs)
                ratios[f"{name}_over_vllm_fp8"] = round(cold / theirs, 3)
    for shape in SHAPES:
        f = parts / f"trtllm_{shape}.json"
        if f.exists():
            results[f"trtllm_{shape}"] = json.loads(f.read_text())
            stamps.append({k: results[f"trtllm_{shape}"][k] for k in ("device", "commit")})
            ratios[f"{shape}_over_trtllm_published"] = results[f"trtllm_{shape}"]["over_trtllm_published"]
            theirs = _vllm_output_tok_s(parts / f"vllm_fp8_trtllm_{shape}.json", MODEL)
            if theirs:
                results[f"trtllm_{shape}"]["vllm_fp8_output_tokens_per_s"] = theirs
                ratios[f"{shape}_over_vllm_fp8"] = round(results[f"trtllm_{shape}"]["output_tokens_per_s"] / theirs, 3)
    caps = {kv: json.loads((parts / f"capacity_{kv}.json").read_text())
            for kv in ("auto", "fp8") if (parts / f"capacity_{kv}.json").exists()}
    stamps += [{k: c[k] for k in ("device", "commit")} for c in caps.values()]
    if caps:
        results["kv_capacity_4k"] = caps
        if len(caps) == 2:
            ratios["kv_capacity_fp8_over_bf16"] = round(caps["fp8"]["largest_batch"] / caps["auto"]["largest_batch"], 3)
    online = parts / "online_fp8.json"  # vs_vllm.py collect over the online phase's files (parts/online/)
    if online.exists():
        doc = json.loads(online.read_text())
        stamps.append({"device": doc["device"], "commit": doc["commit"]})
        results["online"] = {"command": doc["command"], "commit": doc["commit"], "config": doc["config"],
                             **doc["results"]["online"]}
        for key, value in doc["ratios"].items():
            metric, _, rate = key.partition("_over_vllm_")
            if rate:  # tpot_p50_over_vllm_r10 -> online_r10_tpot_p50_over_vllm_fp8
                ratios[f"online_{rate}_{metric}_over_vllm_fp8"] = value
    for name, key in (("fp8_gemm_ab", "gemms"), ("fp8_kv_scales", None)):
        f = parts / f"{name}.json"
        if f.exists():  # kernel A/Bs: kept whole, with their own commit (not stamps: no vLLM side)
            doc = json.loads(f.read_text())
            results[name] = {"commit": doc["commit"], "command": doc.get("command"),
                             **(doc["results"] if key else {k: v for k, v in doc.items() if k not in ("switches", "versions")})}
    vllm_runs = sorted(parts.glob("vllm_fp8_*.json"))
    docs = {f.name: json.loads(f.read_text()) for f in vllm_runs}
    vllm_note = ("not measured" if not vllm_runs else
                 "; ".join(f"{name}: {d['device']}, {d['date']}, model {Path(d['config']['model_config']).parent.name}, "
                           f"{d['command'].split('bench_vllm.py', 1)[-1].strip()}" for name, d in docs.items()))
    if note:
        vllm_note += f" ({note})"
    devices, commits = {s["device"] for s in stamps}, sorted({s["commit"] for s in stamps})
    if len(devices) != 1:
        raise SystemExit(f"the parts come from several devices {devices}: re-run them on one")
    write_result(output, "fp8", None, {"model": MODEL, "load_format": "dummy", "switches": FP8,
                                       "trtllm_published": TRTLLM_PUBLISHED, "shapes": SHAPES},
                 results, {"vllm_0.26_fp8": vllm_note}, ratios,
                 device=devices.pop(), measured_commit=commits[0] if len(commits) == 1 else
                 "several (each result's commit): " + ", ".join(commits), switches=FP8)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("section", choices=["trtllm", "capacity", "collect"])
    ap.add_argument("arg", nargs="?", help="trtllm: 128_128 or 128_2048; capacity: auto or fp8")
    ap.add_argument("--parts", default="benchmarks/results/h200/fp8_parts")
    ap.add_argument("--output", default="benchmarks/results/h200/fp8.json")
    ap.add_argument("--note", default=None, help="collect: how and when the vLLM side ran, kept in the result")
    args = ap.parse_args()
    git_commit()
    parts = Path(args.parts)
    parts.mkdir(parents=True, exist_ok=True)
    if args.section == "trtllm":
        print(json.dumps(trtllm(args.arg, parts), indent=2))
    elif args.section == "capacity":
        print(json.dumps(capacity(args.arg, parts), indent=2))
    else:
        collect(parts, Path(args.output), args.note)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
