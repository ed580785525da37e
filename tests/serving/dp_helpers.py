"""Shared by the DP tests: a `pagedserve serve --data-parallel-size 2` process, a
shared-prefix workload, and per-replica prefix-cache figures read from /metrics."""
from __future__ import annotations

import os
import random
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from pagedserve.benchmark.server_process import free_port, stop_process, wait_until_ready

REPO = Path(__file__).resolve().parents[2]
API_KEY = "sk-dp-test"
# The mp replicas' own key (launch.py makes one per launch unless this is set): the tests call
# replicas directly for their baselines.
REPLICA_KEY = "sk-dp-replica-test"
REPLICA_HEADERS = {"Authorization": f"Bearer {REPLICA_KEY}"}
MODEL = "demo"
BLOCK_SIZE = 16
# Enough blocks that no run of the workload evicts another's prefixes.
REPLICA_FLAGS = ("--device", "cpu", "--dtype", "float32", "--block-size", str(BLOCK_SIZE),
                 "--num-gpu-blocks-override", "1024", "--swap-space", "0.05",
                 "--max-model-len", "512", "--max-num-seqs", "32")


@dataclass
class DPServer:
    base_url: str
    proc: subprocess.Popen
    log_path: Path

    @property
    def v1(self) -> str:
        return self.base_url + "/v1"

    @property
    def headers(self) -> dict:
        return {"Authorization": f"Bearer {API_KEY}"}

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-6000:]

    def health(self) -> tuple[int, dict]:
        """With the key: the replicas' details come only to a caller holding it."""
        r = httpx.get(self.base_url + "/health", headers=self.headers, timeout=60)
        return r.status_code, r.json()


def child_env() -> dict:
    # Ray Serve's proxy gets 5 s to answer its readiness check (10 s for health) before the
    # controller kills it: a busy 2-core CI machine can miss that while the replicas load, and
    # `serve.start` then fails. These tests are about our routing, not Ray's start-up deadlines.
    return dict(os.environ, PYTHONPATH=f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
                TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS="1", RAY_USAGE_STATS_ENABLED="0",
                RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S="60", RAY_SERVE_PROXY_HEALTH_CHECK_TIMEOUT_S="60",
                PAGEDSERVE_REPLICA_API_KEY=REPLICA_KEY)


def launch_single_server(log_path: Path) -> DPServer:
    """One plain `pagedserve serve` with the replicas' flags, the one-replica baseline, started but
    not waited for (wait_healthy(..., every_replica=False) before using it)."""
    port = free_port()
    cmd = [sys.executable, "-m", "pagedserve.entrypoints.cli", "serve", "--port", str(port),
           "--served-model-name", MODEL, *REPLICA_FLAGS]
    log = open(log_path, "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=child_env(), cwd=REPO)
    return DPServer(f"http://127.0.0.1:{port}", proc, log_path)


def wait_healthy(base_url: str, proc: subprocess.Popen, log: Path, timeout: float,
                 every_replica: bool = True) -> None:
    """Until /health answers 200 (and, with `every_replica`, says {"status": "ok"}); stops the
    server if it never does."""
    try:
        if every_replica:
            wait_until_ready(proc, base_url + "/health", timeout, interval=0.5, log_path=log, log_chars=6000,
                             ready=lambda r: r.json().get("status") == "ok")
        else:
            wait_until_ready(proc, base_url + "/health", timeout, log_path=log, log_chars=6000)
    except RuntimeError:
        stop_process(proc)
        raise


def start_dp_server(log_path: Path, *extra: str, timeout: float = 300.0) -> DPServer:
    """`pagedserve serve --data-parallel-size 2` (extra may pick the backend)."""
    port = free_port()
    cmd = [sys.executable, "-m", "pagedserve.entrypoints.cli", "serve", "--port", str(port),
           "--served-model-name", MODEL, "--api-key", API_KEY, "--data-parallel-size", "2",
           *REPLICA_FLAGS, *extra]
    log = open(log_path, "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=child_env(), cwd=REPO)
    server = DPServer(f"http://127.0.0.1:{port}", proc, log_path)
    wait_healthy(server.base_url, proc, log_path, timeout)
    return server


def per_replica(metrics_text: str, name: str) -> dict[str, float]:
    """replica label -> value of the sample `name` (e.g. vllm:prefix_cache_hits_total)."""
    out = {}
    for family in text_string_to_metric_families(metrics_text):
        for s in family.samples:
            if s.name == name:
                out[s.labels.get("replica", "")] = s.value
    return out


def prefix_cache_totals(metrics_texts: list[str]) -> tuple[float, float]:
    """Sum over replicas (and over the given /metrics texts) of (queries, hits) in tokens."""
    q = h = 0.0
    for text in metrics_texts:
        q += sum(per_replica(text, "vllm:prefix_cache_queries_total").values())
        h += sum(per_replica(text, "vllm:prefix_cache_hits_total").values())
    return q, h


def shared_prefix_workload(seed: int, groups: int = 8, per_group: int = 6,
                           prefix_blocks: int = 6, suffix_len: int = 8) -> list[list[int]]:
    """Prompts (token ids) in groups sharing a long prefix, shuffled."""
    rng = random.Random(seed)
    prompts = []
    for _ in range(groups):
        prefix = [rng.randrange(3, 2000) for _ in range(prefix_blocks * BLOCK_SIZE)]
        for _ in range(per_group):
            prompts.append(prefix + [rng.randrange(3, 2000) for _ in range(suffix_len)])
    rng.shuffle(prompts)
    return prompts




async def arun_workload(client: httpx.AsyncClient, prompts: list[list[int]],
                        concurrency: int = 2) -> None:
    """Send every prompt (max_tokens 4) with `concurrency` in flight; all must succeed."""
    import asyncio
    sem = asyncio.Semaphore(concurrency)

    async def one(prompt):
        async with sem:
            r = await client.post("/v1/completions", json={
                "model": MODEL, "prompt": prompt, "max_tokens": 4, "temperature": 0,
                "ignore_eos": True})
            assert r.status_code == 200, r.text
    await asyncio.gather(*(one(p) for p in prompts))


def run_workload(base_url: str, prompts: list[list[int]], headers: dict | None = None,
                 concurrency: int = 2) -> None:
    import asyncio

    async def go():
        async with httpx.AsyncClient(base_url=base_url, headers=headers or {}, timeout=120) as c:
            await arun_workload(c, prompts, concurrency)
    asyncio.run(go())


def replica_figures(before: list[str], after: list[str]) -> dict:
    """Prefix-cache hit rate and share of requests per replica between two /metrics reads
    (each a list of texts, one per server read)."""
    qb, hb = prefix_cache_totals(before)
    qa, ha = prefix_cache_totals(after)
    served: dict[str, float] = {}
    for i, (b, a) in enumerate(zip(before, after)):
        cb = per_replica(b, "vllm:e2e_request_latency_seconds_count")
        ca = per_replica(a, "vllm:e2e_request_latency_seconds_count")
        for k in ca:  # a replica's own /metrics has no replica label: its position is one
            served[k or str(i)] = served.get(k or str(i), 0) + ca[k] - cb.get(k, 0)
    total = sum(served.values())
    return {"hit_rate": (ha - hb) / (qa - qb) if qa > qb else 0.0,
            "shares": {k: v / total for k, v in sorted(served.items())} if total else {},
            "requests": total}
