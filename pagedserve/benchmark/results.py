"""The one writer of benchmark results, and the one answer to "which code made this figure".

Every result JSON has the same top-level keys (RESULT_KEYS): what ran (benchmark, command,
config), where (device, and host: the CPU and how fast it ran a fixed Python loop), which code
(commit), how it was switched (switches: the PAGEDSERVE_* environment switches, the kernels this
process actually picked, and the engine settings the caller names), and what came out (results,
baselines, ratios).

The commit comes from the git checkout this package lives in, or, where the package is not in
a checkout (a wheel, a plain copy of the tree on a GPU machine), from the stamp written by
`python -m pagedserve.benchmark.results stamp` or by the package build. A stamp is trusted only
while the package's source still hashes to what was stamped. Anything else refuses: a result
must never carry some other repository's commit (a CWD inside another checkout) or "unknown".

Stdlib only at import time: setup.py loads this file to stamp builds, and the simulator's
figures must not pay for importing torch.
"""
from __future__ import annotations

import datetime
import hashlib
import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

PACKAGE_DIR = Path(__file__).resolve().parents[1]
STAMP_NAME = "_build_commit.json"
RESULT_KEYS = ("benchmark", "device", "commit", "date", "command", "switches", "versions", "host", "config",
               "results", "baselines", "ratios")
# Environment switches that change which kernels run (layers/fused.py, attention/backend.py).
ENV_SWITCHES = ("PAGEDSERVE_FUSED", "PAGEDSERVE_FUSED_SAMPLING", "PAGEDSERVE_FUSED_MOE", "PAGEDSERVE_ATTENTION",
                "PAGEDSERVE_INCREMENTAL_INPUTS", "PAGEDSERVE_TP_ALLREDUCE", "PAGEDSERVE_STEP_TRACE",
                "PAGEDSERVE_DECODE_SPLIT_TOKENS", "PAGEDSERVE_DECODE_SHARE", "PAGEDSERVE_DECODE_SLOT_GAIN",
                "PAGEDSERVE_DECODE_LAUNCH", "PAGEDSERVE_DECODE_LAUNCH_FP8",
                "PAGEDSERVE_SHORT_PREFILL_GRAPHS", "PAGEDSERVE_PREFILL_LAUNCH", "PAGEDSERVE_UNIFIED_LAUNCH",
                "PAGEDSERVE_LONG_PREFILL", "PAGEDSERVE_LONG_PREFILL_MERGE", "PAGEDSERVE_LONG_PREFILL_FIRST",
                "PAGEDSERVE_LONG_PREFILL_SQUARE", "PAGEDSERVE_LONG_PREFILL_TAIL", "PAGEDSERVE_LONG_PREFILL_FOLD",
                "PAGEDSERVE_LONG_PREFILL_GATHER", "PAGEDSERVE_LONG_PREFILL_PREFIX",
                "PAGEDSERVE_PIECEWISE_MAX_TOKENS", "PAGEDSERVE_NANO_PRIORITY", "PAGEDSERVE_ROPE_STORE",
                "PAGEDSERVE_FP8_QUANT", "PAGEDSERVE_FP8_FUSE", "PAGEDSERVE_FP8_GEMM",
                "PAGEDSERVE_GRAMMAR_FILL", "PAGEDSERVE_GRAMMAR_FILL_POOL")
# EngineConfig fields that switch engine behaviour, and the batch limits (their defaults follow the
# device); absent fields are skipped.
ENGINE_SWITCH_FIELDS = ("async_scheduling", "enforce_eager", "cudagraph_mode", "enable_prefix_caching",
                        "enable_chunked_prefill", "preemption_mode", "kv_allocator", "tensor_parallel_size",
                        "enable_expert_parallel",
                        "max_num_seqs", "max_num_batched_tokens", "cuda_graph_sizes", "quantization",
                        "kv_cache_dtype", "calculate_kv_scales",
                        "kv_cache_scale_strategy", "nano_batch_rows", "nano_batch_sm_carveout", "hf_overrides")


class UnknownCommitError(RuntimeError):
    """The code that would produce a result cannot be named; no result is written."""


def _git(args: list[str], cwd: Path) -> str:
    # GIT_DIR / GIT_WORK_TREE from the caller's environment would point git at another repository.
    env = {k: v for k, v in os.environ.items() if not k.startswith("GIT_")}
    return subprocess.check_output(["git", *args], cwd=cwd, env=env, text=True,
                                   stderr=subprocess.DEVNULL).strip()


def _checkout_commit(package_dir: Path) -> str | None:
    """HEAD of the checkout whose top level holds `package_dir` and tracks its __init__.py, "+dirty" if
    tracked files differ or the package holds files git does not know (not ignored): a tuned table
    added since HEAD changes what runs, and a stale .git travelling with a copy of the tree (the GPU
    machine's did) sees the newer files only as untracked. None for a copy inside another repository."""
    root = package_dir.parent
    try:
        if Path(_git(["rev-parse", "--show-toplevel"], root)).resolve() != root.resolve():
            return None
        _git(["ls-files", "--error-unmatch", f"{package_dir.name}/__init__.py"], root)
        sha = _git(["rev-parse", "HEAD"], root)
        dirty = (_git(["status", "--porcelain", "--untracked-files=no"], root)
                 or _git(["status", "--porcelain", "--untracked-files=all", "--", package_dir.name], root))
    except (OSError, subprocess.CalledProcessError):
        return None
    return sha + ("+dirty" if dirty else "")


def source_hash(package_dir: Path | None = None) -> str:
    """sha256 over the package's .py and .json files but the stamp (relative paths and contents, in
    sorted order): the JSON files are data the code runs by, such as the fused MoE's tuned tables."""
    package_dir = package_dir or PACKAGE_DIR
    h = hashlib.sha256()
    files = [f for f in [*package_dir.rglob("*.py"), *package_dir.rglob("*.json")] if f.name != STAMP_NAME]
    for f in sorted(files):
        h.update(f.relative_to(package_dir).as_posix().encode() + b"\0" + f.read_bytes() + b"\0")
    return h.hexdigest()


def write_stamp(package_dir: Path | None = None, commit: str | None = None) -> Path:
    """Record the checkout's commit and the source hash beside the package (for copies without .git)."""
    package_dir = package_dir or PACKAGE_DIR
    commit = commit or _checkout_commit(package_dir)
    if commit is None:
        raise UnknownCommitError(f"{package_dir.parent} is not a git checkout: nothing to stamp")
    path = package_dir / STAMP_NAME
    path.write_text(json.dumps({"commit": commit, "source_sha256": source_hash(package_dir)}) + "\n")
    return path


def git_commit(package_dir: Path | None = None) -> str:
    """The pagedserve commit this code is, or UnknownCommitError; never the CWD's repository."""
    package_dir = package_dir or PACKAGE_DIR
    commit = _checkout_commit(package_dir)
    if commit is not None and not commit.endswith("+dirty"):
        return commit
    # A stamp that matches the source names the code exactly; it wins over a dirty checkout, which may
    # be a stale .git travelling with a copy of the tree (the GPU machine's copy had one).
    stamp = package_dir / STAMP_NAME
    if stamp.exists():
        data = json.loads(stamp.read_text())
        if data.get("source_sha256") == source_hash(package_dir):
            return data["commit"]
        if commit is None:
            raise UnknownCommitError(f"{stamp} names {data.get('commit')}, but the package's source has "
                                     "changed since it was stamped: stamp again")
    if commit is not None:
        return commit
    raise UnknownCommitError(
        f"{package_dir} is neither in a git checkout nor stamped: run "
        "`python -m pagedserve.benchmark.results stamp` in the checkout before copying it")


def device_name() -> str:
    import torch
    return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"


def engine_switches(engine_config: Any = None) -> dict:
    """ENV_SWITCHES as set (None = unset, the default), the kernels this process picked, and the
    ENGINE_SWITCH_FIELDS of `engine_config` (an EngineConfig or a dict of its fields)."""
    out: dict = {k: os.environ.get(k) for k in ENV_SWITCHES}
    # Only modules this process already imported: asking must not import torch.
    for key, module in {"fused_layer_ops": "pagedserve.layers.fused",
                        "attention_kernels": "pagedserve.attention.backend"}.items():
        picked = sys.modules[module].choices() if module in sys.modules else {}
        if picked:
            out[key] = picked
    if "pagedserve.layers.fused" in sys.modules:
        picked = sys.modules["pagedserve.layers.fused"].choices(sampling=True)
        if picked:
            out["fused_sampling"] = picked
        picked = sys.modules["pagedserve.layers.fused"].choices(moe=True)
        if picked:
            out["fused_moe"] = picked
    if "pagedserve.layers.quant.fusion" in sys.modules:  # its default changed (off, then on): say which ran
        out["fp8_activation_fusion"] = sys.modules["pagedserve.layers.quant.fusion"].fusion_enabled()
    fp8_ops = sys.modules.get("pagedserve.layers.quant.fp8_ops")
    if fp8_ops is not None and fp8_ops._GEMM_MODE is not None:  # read once FP8 ran: its default may flip
        out["fp8_gemm"] = fp8_ops._GEMM_MODE
    if engine_config is not None:
        get = engine_config.get if isinstance(engine_config, dict) else (lambda k, d: getattr(engine_config, k, d))
        missing = object()
        for name in ENGINE_SWITCH_FIELDS:
            value = get(name, missing)
            if value is not missing:
                out[name] = value
    return out


def _versions() -> dict:
    """Python, torch / triton / transformers where this process imported them, and the HTTP
    parser and event loop a server started from this environment runs on."""
    from pagedserve.entrypoints.http_stack import http_stack
    out = {"python": sys.version.split()[0]}
    for name in ("torch", "triton", "transformers"):
        mod = sys.modules.get(name)
        if mod is not None and hasattr(mod, "__version__"):
            out[name] = str(mod.__version__)
    return {**out, **{f"uvicorn_{k}": v for k, v in http_stack().items()}}


def host_info() -> dict:
    """The CPU this process runs on, and the best of three timings of a fixed pure-Python loop.
    Why: the same GPU kind comes with different hosts from one lease to the next, and whatever is
    host-bound (a scheduler, eagerly launched kernels) moves with the host's speed."""
    cpu = None
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), None)
    except OSError:
        pass
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        x = 0
        for i in range(200_000):
            x += i & 7
        best = min(best, time.perf_counter() - t0)
    return {"cpu": cpu, "logical_cpus": os.cpu_count(), "python_loop_ms": round(best * 1e3, 2)}


def default_command() -> str:
    return "python " + shlex.join(sys.argv)


def write_result(path: str | Path, name: str, command: str | None, config: dict, results: dict,
                 baselines: dict | None = None, ratios: dict | None = None,
                 table_md: str | Callable[[dict], str] | None = None, *, device: str | None = None,
                 switches: dict | None = None, extra: dict | None = None, measured_commit: str | None = None,
                 host: dict | None = None, date: str | None = None) -> dict:
    """Write `path` (JSON, RESULT_KEYS first, then `extra`) and a markdown table beside it.

    command: how to re-run it (default: this process's argv). device: default the CUDA device's
    name, or "cpu". switches: merged over engine_switches() (pass engine_switches(cfg) to record
    an engine's settings). measured_commit: the code a result assembled from earlier runs measured
    (this checkout's commit is then kept as collected_at_commit); host: the machine those runs were
    on (default: this process's, host_info()); date: the day those runs were made (default:
    today, UTC; a result re-collected later from old records keeps its lease's). table_md: the markdown, or a
    function of the document. Raises
    UnknownCommitError before writing anything if the commit cannot be named.
    """
    here = git_commit()
    # Assembled from runs made elsewhere: `commit` is the code those runs were, this one collected them.
    commit_fields = {"commit": measured_commit, "collected_at_commit": here} if measured_commit else {"commit": here}
    day = datetime.date.fromisoformat(date) if date else datetime.datetime.now(datetime.timezone.utc).date()
    doc = {"benchmark": name, "device": device or device_name(), **commit_fields, "date": day.isoformat(),
           "command": command or default_command(), "switches": {**engine_switches(), **(switches or {})},
           "versions": _versions(), "host": host or host_info(), "config": config, "results": results, "baselines": baselines or {},
           "ratios": ratios or {}, **(extra or {})}
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=2) + "\n")
    md = table_md(doc) if callable(table_md) else table_md
    path.with_suffix(".md").write_text((md or _default_table(doc)) + "\n")
    return doc


def _default_table(doc: dict) -> str:
    rows = {**doc["results"], **{f"ratio.{k}": v for k, v in doc["ratios"].items()}}
    return "\n".join([f"# {doc['benchmark']}", "", f"`{doc['command']}`", "",
                      f"{doc['device']}, commit {doc['commit']}, {doc['date']}, switches "
                      + ", ".join(f"{k}={v}" for k, v in doc["switches"].items()), "",
                      "| key | value |", "|---|---|"]
                     + [f"| {k} | {v} |" for k, v in rows.items() if not isinstance(v, (list, dict))])


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv == ["stamp"]:
        print(write_stamp())
        return 0
    if argv == ["commit"]:
        print(git_commit())
        return 0
    print("usage: python -m pagedserve.benchmark.results stamp|commit", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
