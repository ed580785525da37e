"""Across machines, through torch.distributed's standard env:// rendezvous: two processes started
separately (as torchrun starts one per node: MASTER_ADDR, MASTER_PORT, WORLD_SIZE, RANK,
LOCAL_RANK), here on loopback. Rank 0 runs the engine; rank 1 runs the ordinary CLI command,
which turns itself into the worker. Their greedy tokens equal TP=1's."""
import json
import os
import subprocess
import sys

import pytest

from pagedserve import LLM
from pagedserve.runner.dist_env import free_port
from tp_helpers import PROMPTS, greedy

RANK0 = """
import json, sys
sys.path.insert(0, sys.argv[2])
from tp_helpers import PROMPTS, greedy
from pagedserve import LLM
llm = LLM(sys.argv[1], device="cpu", num_gpu_blocks_override=64, block_size=8, tensor_parallel_size=2)
ids, _ = greedy(llm, PROMPTS, 12, logprobs=None)
llm.shutdown()
print("TOKENS " + json.dumps(ids), flush=True)
"""


@pytest.mark.timeout(300)
def test_two_processes_via_env_rendezvous_match_tp1(tiny_model_dir):
    model = str(tiny_model_dir("qwen3", num_key_value_heads=1))
    ref, _ = greedy(LLM(model, device="cpu", num_gpu_blocks_override=64, block_size=8), PROMPTS, 12, logprobs=None)
    port = free_port()
    base = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE="2", LOCAL_RANK="0",
                PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    here = os.path.dirname(__file__)
    # Rank 1 first and with arguments rank 0 never sees: it must wait for, and obey, rank 0.
    worker = subprocess.Popen([sys.executable, "-m", "pagedserve.entrypoints.cli", "generate", "ignored prompt",
                               "--model", model, "--tensor-parallel-size", "2"], env=dict(base, RANK="1"),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    engine = subprocess.Popen([sys.executable, "-c", RANK0, model, here], env=dict(base, RANK="0"),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out, err = engine.communicate(timeout=240)
        assert engine.returncode == 0, err[-3000:]
        assert worker.wait(timeout=60) == 0, worker.stderr.read()[-3000:]
    finally:
        for p in (engine, worker):
            if p.poll() is None:
                p.kill()
                p.wait()
    line = next(ln for ln in out.splitlines() if ln.startswith("TOKENS "))
    assert json.loads(line[len("TOKENS "):]) == ref
    assert worker.stdout.read() == ""  # the worker never ran a `generate` of its own
