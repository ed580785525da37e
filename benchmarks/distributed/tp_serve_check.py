"""Does `pagedserve serve --tensor-parallel-size N` answer the openai client? (dummy weights)

Starts the server in its own session (rank 0 and its workers die together), waits for /health,
asks /v1/models, a token-id completion and a streamed one through the `openai` client, checks the
answers' shape (dummy weights produce arbitrary tokens, so only the plumbing is judged), then
stops the server. The model directories in benchmarks/models hold configs only, so the server
runs with --skip-tokenizer-init and the prompts are token ids. Every wait is bounded; a hang
costs --timeout seconds. Writes a JSON summary to --out (default $OUT/tp_serve.json when $OUT
is set) and the server's log beside it.

    NCCL_NVLS_ENABLE=0 python benchmarks/distributed/tp_serve_check.py                    # 2 GPUs, Llama-3.1-8B
    python benchmarks/distributed/tp_serve_check.py --smoke --device cpu                  # tiny model, CPU
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from pagedserve.benchmark.server_process import free_port, wait_until_ready  # noqa: E402


def tiny_checkpoint(out_dir: Path) -> Path:
    """A small random Llama checkpoint (for --smoke): the same plumbing without a GPU."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=512, max_position_embeddings=512)
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).save_pretrained(out_dir, safe_serialization=True)
    return out_dir


def ask(base: str, vocab: int, timeout: float) -> dict:
    from openai import OpenAI
    client = OpenAI(base_url=base + "/v1", api_key="unused", timeout=timeout, max_retries=0)
    models = [m.id for m in client.models.list().data]
    prompt = [(7 * i + 3) % vocab for i in range(32)]
    done = client.completions.create(model=models[0], prompt=prompt, max_tokens=16, temperature=0.0,
                                     extra_body={"ignore_eos": True})
    usage = done.usage
    assert usage.prompt_tokens == len(prompt) and usage.completion_tokens == 16, usage
    chunks = list(client.completions.create(model=models[0], prompt=prompt, max_tokens=8, temperature=0.0,
                                            stream=True, extra_body={"ignore_eos": True}))
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finish == ["length"], finish
    return {"models": models, "completion_tokens": usage.completion_tokens,
            "finish_reason": done.choices[0].finish_reason, "stream_chunks": len(chunks)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=str(ROOT / "benchmarks/models/llama-3.1-8b"))
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--timeout", type=float, default=600, help="seconds for start-up; each request gets 120")
    ap.add_argument("--smoke", action="store_true", help="tiny random model (use with --device cpu)")
    out_default = os.path.join(os.environ["OUT"], "tp_serve.json") if os.environ.get("OUT") else None
    ap.add_argument("--out", default=out_default)
    args = ap.parse_args()

    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    os.environ.setdefault("PAGEDSERVE_TP_PHASE_TIMEOUT", str(max(30, int(args.timeout * 0.6))))
    work = Path(tempfile.mkdtemp(prefix="tp_serve_"))
    model = tiny_checkpoint(work / "tiny") if args.smoke else Path(args.model)
    max_len = min(args.max_model_len, 512) if args.smoke else args.max_model_len
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    port = free_port()
    cmd = [sys.executable, "-m", "pagedserve.entrypoints.cli", "serve", str(model), "--port", str(port),
           "--tensor-parallel-size", str(args.tp), "--device", args.device, "--skip-tokenizer-init",
           "--max-model-len", str(max_len), "--served-model-name", model.name]
    if not args.smoke:
        cmd += ["--load-format", "dummy", "--dtype", "bfloat16"]
    log_path = Path(args.out).with_suffix(".log") if args.out else work / "server.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p),
               TOKENIZERS_PARALLELISM="false")
    print("+", " ".join(cmd), flush=True)
    t0 = time.monotonic()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT, start_new_session=True)
    summary = {"command": cmd, "tp": args.tp, "env": {k: v for k, v in sorted(os.environ.items())
                                                       if k.startswith(("PAGEDSERVE_", "NCCL_"))}}
    code = 1
    try:
        base = f"http://127.0.0.1:{port}"
        wait_until_ready(proc, base + "/health", t0 + args.timeout - time.monotonic(), interval=1,
                         log_path=log_path, log_chars=4000)
        summary["startup_s"] = round(time.monotonic() - t0, 1)
        summary.update(ask(base, vocab, timeout=120))
        summary["ok"] = True
        code = 0
    except Exception as e:
        summary.update(ok=False, error=f"{type(e).__name__}: {e}")
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)  # a clean shutdown first: rank 0 stops its workers
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        summary["server_exit_code"] = proc.returncode
    print(json.dumps(summary, indent=2))
    if args.out:
        Path(args.out).write_text(json.dumps(summary, indent=2) + "\n")
    return code


if __name__ == "__main__":
    sys.exit(main())
