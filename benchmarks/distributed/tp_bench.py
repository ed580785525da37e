"""Tensor parallelism on two GPUs: does TP=2 compute what TP=1 does, and how much faster is it?

1. Agreement (bf16, greedy): a random-weight checkpoint of Qwen3-0.6B's architecture is written
   once and loaded at TP=1 and at TP=2. Per prompt, the two token streams must be equal, or at
   their first difference each engine's token must be among the other's top-5 logprobs (bf16
   all-reduces sum in a different order, so a near-tie may flip; after that the contexts
   differ and the comparison stops).
2. Throughput: `fixed256` (docs/benchmarks.md's draw) with dummy weights on Llama-3.1-8B and on
   OPT-13B, each at TP=1 and TP=2, timed by pagedserve.benchmark.throughput.run_throughput.

Every engine runs in its own process (its own session, killed whole after --child-timeout
seconds), so each gets clean GPUs and a hang costs minutes, not the machine. The engines run
with PAGEDSERVE_TP_PHASE_TIMEOUT / PAGEDSERVE_TP_STEP_TIMEOUT set below the child timeout, so a
stuck rank fails with the rank and phase named before the child is killed. Progress goes to
--progress-dir (default $OUT when set) as it happens: progress.log (one line per event, each
child's output in <child>.log) and tp.partial.json after every child. A failed child is recorded
under results.errors and the rest still run. Writes benchmarks/results/h200x2/tp.json with
ratios.tp2_over_tp1_throughput (Llama-3.1-8B, total tokens/s), its OPT-13B twin, the commit and
the engine switches (config.engine_env).

    NCCL_NVLS_ENABLE=0 python benchmarks/distributed/tp_bench.py    # on a host with 2 GPUs
    python benchmarks/distributed/tp_bench.py --smoke --device cpu  # the same plumbing on a tiny model, CPU
"""
from __future__ import annotations

import argparse
import json
import os
import random
import shlex
import faulthandler
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

MODELS = {"llama-3.1-8b": (ROOT / "benchmarks/models/llama-3.1-8b", 4096),
          "opt-13b": (ROOT / "benchmarks/models/opt-13b", 2048)}
AGREEMENT_ARCH = ROOT / "benchmarks/models/qwen3-0.6b"
TOP_K = 5


# ---- children: one engine each ------------------------------------------------------------------

def same_settings(async_scheduling: str) -> dict:
    """What both TP sizes run with, so the ratio is tensor parallelism's alone. Steps overlap at
    every TP size (runner/sampled_ids.py); --async-scheduling off is the A/B (and what the runs
    before overlapped TP steps measured)."""
    return {"async_scheduling": async_scheduling == "on", "cudagraph_mode": "decode"}


def child_agreement(args) -> dict:
    from pagedserve import LLM, SamplingParams
    llm = LLM(args.model, dtype=args.dtype, device=args.device, tensor_parallel_size=args.tp,
              skip_tokenizer_init=True, max_model_len=args.max_model_len, seed=0)
    rng = random.Random(0)
    vocab = llm.llm_engine.vocab_size
    prompts = [{"prompt_token_ids": [rng.randrange(min(vocab, 10000)) for _ in range(rng.randint(16, 128))]}
               for _ in range(args.num_prompts)]
    sp = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True, logprobs=TOP_K)
    outs = llm.generate(prompts, sp, use_tqdm=False)
    result = {"tokens": [o.outputs[0].token_ids for o in outs],
              "top": [[sorted(lp, key=lambda t: lp[t].logprob, reverse=True)[:TOP_K] for lp in o.outputs[0].logprobs]
                      for o in outs]}
    return result, llm


def child_throughput(args) -> dict:
    from pagedserve.benchmark.throughput import run_throughput
    # TP>1 steps run without piecewise graphs: TP=1 runs the same way, so the ratio is tensor
    # parallelism's alone.
    kwargs = {"max_model_len": args.max_model_len, "tensor_parallel_size": args.tp, "device": args.device,
              **same_settings(args.async_scheduling)}
    if args.dtype != "auto":
        kwargs["dtype"] = args.dtype
    return run_throughput("fixed256", args.model, kwargs, args.num_requests, repeats=2, measure_roofline=False)


class Progress:
    """Where the run stands, on disk as it happens (the GPU machine returns only what is under $OUT)."""

    def __init__(self, folder: str | None):
        self.folder = Path(folder) if folder else None
        if self.folder:
            self.folder.mkdir(parents=True, exist_ok=True)
        self.t0 = time.monotonic()

    def log(self, msg: str) -> None:
        line = f"[{time.monotonic() - self.t0:7.1f} s] {msg}"
        print(line, flush=True)
        if self.folder:
            with open(self.folder / "progress.log", "a") as f:
                f.write(line + "\n")

    def child_log(self, name: str) -> Path | None:
        return self.folder / f"{name}.log" if self.folder else None

    def snapshot(self, doc: dict) -> None:
        if self.folder:
            from pagedserve.benchmark.results import engine_switches
            (self.folder / "tp.partial.json").write_text(
                json.dumps({"switches": engine_switches(), **doc}, indent=2) + "\n")


class ChildFailed(RuntimeError):
    pass


def run_child(kind: str, out: Path, progress: Progress, timeout_s: float, name: str, **kw) -> dict:
    """One engine in its own session; the whole session (rank 0 and its workers) dies on timeout."""
    cmd = [sys.executable, __file__, "--child", kind, "--child-out", str(out), "--child-timeout", str(timeout_s)]
    for k, v in kw.items():
        if v is not None:
            cmd += [f"--{k.replace('_', '-')}", str(v)]
    progress.log(f"start {name}: {shlex.join(cmd)}")
    log_path = progress.child_log(name)
    log = open(log_path, "w") if log_path else None
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=ROOT, start_new_session=True, stdout=log,
                            stderr=subprocess.STDOUT if log else None)
    try:
        code = proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        code = None
    finally:
        if log:
            log.close()
    took = time.monotonic() - t0
    if code != 0:
        tail = log_path.read_text()[-3000:] if log_path else ""
        what = f"timed out after {timeout_s:.0f} s (killed)" if code is None else f"exited with code {code}"
        progress.log(f"FAILED {name}: {what}\n{tail}")
        raise ChildFailed(f"{name} {what}; last output:\n{tail}")
    progress.log(f"done {name} in {took:.0f} s")
    return json.loads(out.read_text())


def engine_env() -> dict:
    """The switches the engines ran with: every PAGEDSERVE_* and NCCL_* variable in the environment."""
    return {k: v for k, v in sorted(os.environ.items()) if k.startswith(("PAGEDSERVE_", "NCCL_"))}


# ---- the comparison --------------------------------------------------------------------------------

def compare(a: dict, b: dict) -> dict:
    """Per prompt: identical, or at the first difference each token is in the other's top-5."""
    identical = within = 0
    first_diff = []
    for ta, tb, top_a, top_b in zip(a["tokens"], b["tokens"], a["top"], b["top"]):
        if ta == tb:
            identical += 1
            continue
        i = next(i for i, (x, y) in enumerate(zip(ta, tb)) if x != y)
        first_diff.append(i)
        if ta[i] in top_b[i] and tb[i] in top_a[i]:
            within += 1
    n = len(a["tokens"])
    return {"num_prompts": n, "identical": identical, "differ_within_top5": within,
            "differ_outside_top5": n - identical - within, "first_difference_positions": first_diff,
            "all_agree_or_within_top5": identical + within == n}


def write_random_checkpoint(arch_dir: Path, out_dir: Path, smoke: bool) -> None:
    """Random weights of the architecture in arch_dir, saved as safetensors (bf16; fp32 for the smoke run)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    d = json.loads((arch_dir / "config.json").read_text())
    if smoke:
        d.update(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, vocab_size=10240, bos_token_id=0, eos_token_id=1)
        d.pop("layer_types", None)
    cfg = AutoConfig.for_model(d.pop("model_type"), **d)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32 if smoke else torch.bfloat16)
    model.save_pretrained(out_dir, safe_serialization=True)


def ratio_key(name: str) -> str:
    return "tp2_over_tp1_throughput" if name == "llama-3.1-8b" else f"tp2_over_tp1_throughput_{name}"


def throughput_ratios(results: dict) -> dict:
    """TP=2 over TP=1 total tokens/s for every model with both runs."""
    out = {}
    for key, runs in results.items():
        if key.startswith("fixed256_") and "tp1" in runs and "tp2" in runs:
            out[ratio_key(key[len("fixed256_"):])] = round(
                runs["tp2"]["total_tokens_per_s"] / runs["tp1"]["total_tokens_per_s"], 3)
    return out


def merge(paths: list[str], out: str) -> None:
    """One tp.json from several partial ones: results and ratios united, configs side by side."""
    from pagedserve.benchmark.results import write_result
    docs = [json.loads(Path(p).read_text()) for p in paths]
    commits = sorted({d["config"].get("commit", d.get("commit")) for d in docs})
    if len(commits) > 1:
        raise SystemExit(f"refusing to merge runs of different commits: {commits}")
    # The runs' switches, not the merging shell's: a run with e.g. PAGEDSERVE_TP_ALLREDUCE set
    # must not be united with one without it under either's name.
    # (Partial files written before they carried switches have none: they constrain nothing.)
    switches = [d["switches"] for d in docs if "switches" in d]
    if any(sw != switches[0] for sw in switches[1:]):
        raise SystemExit(f"refusing to merge runs with different switches: {switches}")
    # A tp.partial.json (a run cut off before its tp.json) has no command line of its own.
    merged_from = [d.get("command", f"{p} (the tp.partial.json of a run that ended before writing tp.json)")
                   for p, d in zip(paths, docs)]
    results, ratios, config = {}, {}, {"merged_from": merged_from, "commit": commits[0]}
    for d in docs:
        errors = {**results.get("errors", {}), **d.get("errors", {}), **d["results"].get("errors", {})}
        for key, value in d["results"].items():
            results[key] = {**results.get(key, {}), **value} if key.startswith("fixed256_") else value
        if errors:
            results["errors"] = errors
        ratios.update(d["ratios"])
        for k, v in d["config"].items():
            config.setdefault(k, v)
    ratios.update(throughput_ratios(results))
    # The runs' device and commit, not the merging machine's (a partial file names no device).
    device = next((d["device"] for d in docs if d.get("device")), None)
    doc = write_result(out, "tp", "python benchmarks/distributed/tp_bench.py --merge " + " ".join(paths), config, results, {},
                       ratios, device=device, measured_commit=commits[0],
                       switches=switches[0] if switches else None)
    print(json.dumps(doc["ratios"], indent=2))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results/h200x2/tp.json"))
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default=None, help="default: bfloat16 (float32 with --smoke)")
    ap.add_argument("--num-requests", type=int, default=None, help="fixed256 subset (default: all 1000)")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--models", default="llama-3.1-8b,opt-13b")
    ap.add_argument("--smoke", action="store_true", help="tiny random model, few requests: checks the plumbing")
    ap.add_argument("--skip-agreement", action="store_true")
    ap.add_argument("--skip-throughput", action="store_true")
    ap.add_argument("--child-timeout", type=float, default=900, help="seconds one engine process may run")
    ap.add_argument("--tp-sizes", default="1,2", help="throughput runs: which TP sizes (split them over "
                    "device-machine commands if one command cannot hold both; --merge joins them)")
    ap.add_argument("--merge", nargs="+", metavar="TP_JSON",
                    help="combine tp.json files of separate runs (e.g. one per device-machine command) into --out")
    ap.add_argument("--progress-dir", default=os.environ.get("OUT"),
                    help="progress.log, per-child logs and tp.partial.json go here (default: $OUT)")
    # child mode
    ap.add_argument("--child", choices=["agreement", "throughput"])
    ap.add_argument("--child-out")
    ap.add_argument("--model")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--async-scheduling", choices=["on", "off"], default="on",
                    help="overlapped steps in the throughput runs, at both TP sizes (off: the A/B)")
    args = ap.parse_args()
    args.dtype = args.dtype or ("float32" if args.smoke else "bfloat16")

    if args.child:
        # A child about to be killed for overrunning first says where every thread is.
        faulthandler.dump_traceback_later(max(5.0, args.child_timeout - 15), exit=False)
        llm = None
        if args.child == "agreement":
            result, llm = child_agreement(args)
        else:
            result = child_throughput(args)
        Path(args.child_out).write_text(json.dumps(result))
        if llm is not None:  # shut down here, timed, not at exit: a teardown hang must show as one
            t0 = time.monotonic()
            llm.shutdown()
            print(f"engine shutdown took {time.monotonic() - t0:.1f} s", flush=True)
        return

    from pagedserve.benchmark.results import git_commit, write_result
    if args.merge:
        merge(args.merge, args.out)
        return
    git_commit()  # refuse before measuring, not after
    # A stuck rank must fail inside the engine (naming rank and phase) before the child is killed.
    bound = max(30, int(args.child_timeout * 0.6))
    os.environ.setdefault("PAGEDSERVE_TP_PHASE_TIMEOUT", str(bound))
    os.environ.setdefault("PAGEDSERVE_TP_STEP_TIMEOUT", str(min(bound, 180)))
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # NVLink multicast stays off on the lent machines
    # One stderr line per pre-phase start-up sub-step of every rank: a child's log is never empty.
    os.environ.setdefault("PAGEDSERVE_TP_DEBUG", "1")
    progress = Progress(args.progress_dir)
    tmp = Path(tempfile.mkdtemp(prefix="tp_bench_"))
    common = dict(device=args.device, dtype=args.dtype)
    results, ratios, errors = {}, {}, {}
    config = {"dtype": args.dtype, "device": args.device, "smoke": args.smoke, "commit": git_commit(),
              "engine_env": engine_env(), "engine_settings_both_tp_sizes": same_settings(args.async_scheduling), "engine_defaults": "EngineConfig defaults (CUDA graphs on, prefix caching "
              "on, gpu_memory_utilization 0.9) unless named here", "child_timeout_s": args.child_timeout}

    def snapshot():
        progress.snapshot({"config": config, "results": results, "ratios": ratios, "errors": errors})

    def child(kind, name, **kw):
        try:
            return run_child(kind, tmp / f"{name}.json", progress, args.child_timeout, name, **kw)
        except ChildFailed as e:
            errors[name] = str(e)
            return None
        finally:
            snapshot()

    if not args.skip_agreement:
        ckpt = tmp / "agreement-ckpt"
        write_random_checkpoint(AGREEMENT_ARCH, ckpt, args.smoke)
        config["agreement"] = {"num_prompts": args.num_prompts, "max_tokens": args.max_tokens, "top_k": TOP_K,
                               "max_model_len": 1024}
        runs = {tp: child("agreement", f"agreement-tp{tp}", model=ckpt, tp=tp, max_model_len=1024,
                          num_prompts=args.num_prompts, max_tokens=args.max_tokens, **common) for tp in (1, 2)}
        if runs[1] is not None and runs[2] is not None:
            results["agreement"] = {"model_arch": str(AGREEMENT_ARCH.relative_to(ROOT)), "random_weights": True,
                                    "max_tokens": args.max_tokens, **compare(runs[1], runs[2])}
            ratios["greedy_identical_fraction"] = round(results["agreement"]["identical"] / args.num_prompts, 3)
            progress.log(f"agreement: {json.dumps(results['agreement'])}")
            snapshot()

    if not args.skip_throughput:
        tp_sizes = [int(t) for t in args.tp_sizes.split(",")]
        num_requests = args.num_requests or (4 if args.smoke else None)
        config["throughput"] = {"workload": "fixed256", "models": args.models.split(","),
                                "num_requests": num_requests or 1000, "load_format": "dummy"}
        for name in args.models.split(","):
            model_dir, max_len = MODELS[name]
            if args.smoke:
                model_dir, max_len = tmp / "agreement-ckpt", 1024
                if not model_dir.exists():
                    write_random_checkpoint(AGREEMENT_ARCH, model_dir, smoke=True)
            config["throughput"][f"{name}_max_model_len"] = max_len
            per_tp = {tp: child("throughput", f"{name}-tp{tp}", model=model_dir, tp=tp, max_model_len=max_len,
                                num_requests=num_requests, async_scheduling=args.async_scheduling, **common)
                      for tp in tp_sizes}
            results[f"fixed256_{name}"] = {f"tp{tp}": r["results"] for tp, r in per_tp.items() if r is not None}
            ratios.update(throughput_ratios(results))
            if ratio_key(name) in ratios:
                progress.log(f"{name}: TP=2 / TP=1 total tokens/s = {ratios[ratio_key(name)]}")
            snapshot()

    if errors:
        results["errors"] = errors
    doc = write_result(args.out, "tp", "python benchmarks/distributed/tp_bench.py " + shlex.join(sys.argv[1:]), config,
                       results, {}, ratios)
    if args.progress_dir:
        Path(args.progress_dir, "tp.json").write_text(json.dumps(doc, indent=2) + "\n")
    progress.log(f"wrote {args.out}: ratios {json.dumps(doc['ratios'])}")
    if errors:
        print(f"{len(errors)} engine run(s) failed: {sorted(errors)} (see results.errors)", file=sys.stderr)
        sys.exit(1)
    if "agreement" in results and not results["agreement"]["all_agree_or_within_top5"]:
        print("TP=2 and TP=1 disagree beyond a near-tie: see results.agreement", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
