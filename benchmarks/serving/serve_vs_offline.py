"""The server's time for N concurrent streams against the offline engine's for the same requests.

Starts `pagedserve serve` (two processes: API server + engine core), waits until it is healthy,
sends N streamed /v1/completions at once (greedy, ignore_eos, max_tokens each) and times the
whole wave from the first send to the last [DONE]. Then stops the server and runs the same
requests through `LLM.generate` in this process. The ratio server/offline is the serving
path's overhead (HTTP, JSON, SSE, IPC, detokenization in the API process); greedy outputs must
be the same text on both sides.

    python benchmarks/serving/serve_vs_offline.py                      # CPU, the bundled demo model
    python benchmarks/serving/serve_vs_offline.py --device cuda --model DIR --max-tokens 256 --output x.json

Prints one JSON object (and writes it to --output): commit, settings, both wall times, ratio.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from pagedserve.benchmark.server_process import free_port, stop_process, wait_until_ready  # noqa: E402


def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def _prompts(n: int) -> list[str]:
    starts = ["In the beginning", "And God said", "The LORD is my shepherd", "Blessed are the",
              "And it came to pass", "Thus saith the LORD", "Let there be", "Now the serpent"]
    return [f"{starts[i % len(starts)]} ({i})" for i in range(n)]


async def _stream(client: httpx.AsyncClient, prompt: str, max_tokens: int) -> tuple[str, int]:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    text, tokens = [], 0
    async with client.stream("POST", "/v1/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread())[:300]!r}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(chunk["error"]["message"])
            text += [c["text"] for c in chunk["choices"]]
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
    return "".join(text), tokens


async def _wave(base_url: str, prompts: list[str], max_tokens: int) -> tuple[float, list[tuple[str, int]]]:
    limits = httpx.Limits(max_connections=len(prompts), max_keepalive_connections=len(prompts))
    async with httpx.AsyncClient(base_url=base_url, timeout=600, limits=limits) as client:
        start = time.perf_counter()
        results = await asyncio.gather(*(_stream(client, p, max_tokens) for p in prompts))
        return time.perf_counter() - start, results


def _engine_flags(args: argparse.Namespace) -> list[str]:
    flags = ["--device", args.device, "--dtype", args.dtype, "--max-num-seqs", str(args.num_streams)]
    if args.model:
        flags = [args.model] + flags
    return flags


def run_server(args: argparse.Namespace, prompts: list[str]) -> tuple[float, list[tuple[str, int]]]:
    port = free_port()
    cmd = [sys.executable, "-m", "pagedserve.entrypoints.cli", "serve", *_engine_flags(args),
           "--port", str(port)]
    env = dict(os.environ, PYTHONPATH=f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    base = f"http://127.0.0.1:{port}"
    try:
        try:
            wait_until_ready(proc, base + "/health", args.start_timeout)
        except RuntimeError as e:
            if proc.poll() is None:
                raise
            raise RuntimeError(f"{e}: {proc.stderr.read()[-2000:]}") from None
        asyncio.run(_wave(base, prompts[:2], 2))  # warm-up: first-call costs are not the path's
        return asyncio.run(_wave(base, prompts, args.max_tokens))
    finally:
        stop_process(proc)


def run_offline(args: argparse.Namespace, prompts: list[str]) -> tuple[float, list[tuple[str, int]]]:
    from pagedserve import LLM, SamplingParams
    from pagedserve.demo_model import DEMO_MODEL_DIR
    llm = LLM(args.model or str(DEMO_MODEL_DIR), device=args.device, dtype=args.dtype,
              max_num_seqs=args.num_streams)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    llm.generate(prompts[:2], SamplingParams(temperature=0.0, max_tokens=2), use_tqdm=False)
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - start
    llm.shutdown()
    return wall, [(o.outputs[0].text, len(o.outputs[0].token_ids)) for o in outs]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="HF model directory (default: the demo model)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--num-streams", type=int, default=48)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--start-timeout", type=float, default=600.0)
    p.add_argument("--output", default=None)
    args = p.parse_args(argv)
    if args.num_streams < 1 or args.max_tokens < 1:
        raise SystemExit("serve_vs_offline: --num-streams and --max-tokens must be >= 1")
    prompts = _prompts(args.num_streams)
    server_wall, server_out = run_server(args, prompts)
    offline_wall, offline_out = run_offline(args, prompts)
    result = {
        "commit": _commit(), "model": args.model or "pagedserve/demo_model", "device": args.device,
        "dtype": args.dtype, "num_streams": args.num_streams, "max_tokens": args.max_tokens,
        "server_wall_s": server_wall, "offline_wall_s": offline_wall,
        "server_over_offline": server_wall / offline_wall,
        "server_tokens": sum(n for _, n in server_out), "offline_tokens": sum(n for _, n in offline_out),
        "same_text": sum(a[0] == b[0] for a, b in zip(server_out, offline_out)),
    }
    text = json.dumps(result, indent=2)
    print(text)
    if args.output:
        Path(args.output).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
