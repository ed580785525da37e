#!/usr/bin/env python3
"""How long `pagedserve serve` takes to start, and whether its first requests still stall.

Launches the server (dummy weights, no tokenizer: token-id prompts), times launch -> /health 200,
reads the warm-up's own time from the log ("warm-up took ... s"), then sends probe requests of
several shapes twice each, one at a time: with no cold start, each shape's first latency equals
its second. Writes one JSON object (stdout, and --output if given).

    python benchmarks/startup_time.py --model benchmarks/models/llama-3.1-8b --output $OUT/startup.json
    PAGEDSERVE_WARMUP=0 python benchmarks/startup_time.py ...      # the same without the warm-up
    python benchmarks/startup_time.py --fresh-triton-cache ...     # compile every kernel from scratch
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from pagedserve.benchmark.server_process import free_port, stop_process, wait_until_ready  # noqa: E402
# (prompt tokens, max_tokens, extra request fields): a decode-heavy one, a long prefill, sampling paths.
PROBES = [(8, 32, {}), (1500, 4, {}), (300, 16, {"temperature": 0.8, "top_p": 0.9, "top_k": 40}),
          (64, 16, {"temperature": 0.7, "seed": 3}), (40, 8, {"frequency_penalty": 0.5})]


def probe(base: str, prompt_len: int, max_tokens: int, extra: dict, salt: int) -> float:
    # A prompt of its own per call (salt), so the second call cannot just hit the prefix cache.
    prompt = [(7 * i + 13 * salt) % 300 + 10 for i in range(prompt_len)]  # ids any vocab holds
    t0 = time.perf_counter()
    r = httpx.post(base + "/v1/completions", timeout=300,
                   json={"model": "bench", "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, **extra})
    if r.status_code != 200:
        raise RuntimeError(f"probe of {prompt_len} tokens: HTTP {r.status_code}: {r.text[:300]}")
    return time.perf_counter() - t0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=str(REPO / "benchmarks/models/llama-3.1-8b"))
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--server-args", default="", help="extra `pagedserve serve` arguments")
    ap.add_argument("--fresh-triton-cache", action="store_true", help="an empty TRITON_CACHE_DIR for this run")
    ap.add_argument("--timeout", type=float, default=900)
    ap.add_argument("--output", type=Path)
    args = ap.parse_args()

    port = free_port()
    env = dict(os.environ, PYTHONPATH=f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
               TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1")
    if args.fresh_triton_cache:
        env["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="triton-cache-")
    cmd = [sys.executable, "-m", "pagedserve.entrypoints.cli", "serve", args.model, "--port", str(port),
           "--served-model-name", "bench", "--load-format", "dummy", "--skip-tokenizer-init",
           "--max-model-len", str(args.max_model_len), *shlex.split(args.server_args)]
    log_path = Path(tempfile.mkstemp(prefix="pagedserve-startup-", suffix=".log")[1])
    base = f"http://127.0.0.1:{port}"
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=open(log_path, "w"), stderr=subprocess.STDOUT, env=env, cwd=REPO,
                            start_new_session=True)
    result: dict = {"command": shlex.join(cmd), "log": str(log_path),
                    "warmup_env": os.environ.get("PAGEDSERVE_WARMUP", "auto"),
                    "fresh_triton_cache": args.fresh_triton_cache}
    try:
        try:
            wait_until_ready(proc, base + "/health", args.timeout - (time.monotonic() - t0), interval=0.25)
        except RuntimeError as e:
            raise RuntimeError(f"{e}; see {log_path}") from None
        result["startup_seconds"] = round(time.monotonic() - t0, 2)
        found = re.findall(r"warm-up took ([0-9.]+) s", log_path.read_text())
        result["warmup_seconds"] = float(found[-1]) if found else None
        result["probes"] = []
        for i, (n, m, extra) in enumerate(PROBES):
            n = min(n, args.max_model_len - m)
            first = probe(base, n, m, extra, 2 * i)
            second = probe(base, n, m, extra, 2 * i + 1)
            result["probes"].append({"prompt_tokens": n, "max_tokens": m, **extra,
                                     "first_s": round(first, 4), "second_s": round(second, 4)})
    finally:
        stop_process(proc, timeout=60, group=True)
    text = json.dumps(result, indent=1)
    print(text)
    if args.output:
        args.output.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
