"""Start and stop a real `pagedserve serve` process (shared by the server tests' fixtures)."""
from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from pagedserve.benchmark.server_process import free_port, stop_process, wait_until_ready

REPO = Path(__file__).resolve().parents[2]
API_KEY = "sk-pagedserve-test"
MAX_MODEL_LEN = 512
NUM_BLOCKS = 512
BLOCK_SIZE = 16


@dataclass
class Server:
    base_url: str           # http://127.0.0.1:PORT
    model: str              # served model name
    model_dir: Path
    api_key: str | None
    proc: subprocess.Popen
    log_path: Path

    @property
    def v1(self) -> str:
        return self.base_url + "/v1"

    @property
    def headers(self) -> dict:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-5000:]

    def metrics(self) -> dict[str, float]:
        """Samples of /metrics with no label but vLLM's model_name (histograms' _sum and _count
        included), by name."""
        from prometheus_client.parser import text_string_to_metric_families
        text = httpx.get(self.base_url + "/metrics", timeout=10).text
        out = {}
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                if set(s.labels) <= {"model_name"}:
                    out[s.name] = s.value
        return out


def start_server(model_dir: Path, log_path: Path, *extra: str, api_key: str | None = None,
                 timeout: float = 180.0, port: int | None = None, tls: Any = None) -> Server:
    """tls: an ssl.SSLContext trusting the server's certificate, for a server given --ssl-* flags."""
    port = port or free_port()
    cmd = [sys.executable, "-m", "pagedserve.entrypoints.cli", "serve", str(model_dir),
           "--port", str(port), "--device", "cpu", "--dtype", "float32",
           "--served-model-name", "tiny", *extra]
    if api_key:
        cmd += ["--api-key", api_key]
    env = dict(os.environ, PYTHONPATH=f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
               TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS="1")
    log = open(log_path, "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO)
    scheme = "https" if tls is not None else "http"
    server = Server(f"{scheme}://127.0.0.1:{port}", "tiny", Path(model_dir), api_key, proc, log_path)
    try:
        wait_until_ready(proc, server.base_url + "/health", timeout, log_path=log_path,
                         verify=tls if tls is not None else True)
    except RuntimeError:
        stop_server(server)
        raise
    return server


def stop_server(server: Server) -> None:
    stop_process(server.proc, timeout=20)
