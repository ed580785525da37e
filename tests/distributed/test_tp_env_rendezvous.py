"""Across machines, through torch.distributed's standard env:// rendezvous, exactly as
docs/tensor-parallel.md says to run one model over two nodes: two torchrun invocations
(--nnodes 2, one process each), here both on loopback with a free port. Node 0 runs a script
that builds the engine; node 1 runs the ordinary `pagedserve generate` command line, which
turns itself into the worker. Their greedy tokens equal TP=1's."""
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
from tp_helpers import PROMPTS, gloo_threads, greedy
from pagedserve import LLM
llm = LLM(sys.argv[1], device="cpu", num_gpu_blocks_override=64, block_size=8, tensor_parallel_size=2)
ids, _ = greedy(llm, PROMPTS, 12, logprobs=None)
llm.shutdown()
print("TOKENS " + json.dumps(ids), flush=True)
# No gloo thread may outlive shutdown: one that finishes a work while the interpreter finalizes
# aborts the process (destroy_distributed says why).
print("GLOO_THREADS " + json.dumps(gloo_threads()), flush=True)
"""


def torchrun(node_rank: int, port: int, *cmd: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
            "--node-rank", str(node_rank), "--master-addr", "127.0.0.1", "--master-port", str(port), *cmd]


@pytest.mark.timeout(300)
def test_two_nodes_via_torchrun_env_rendezvous_match_tp1(tiny_model_dir, tmp_path):
    model = str(tiny_model_dir("qwen3", num_key_value_heads=1))
    ref, _ = greedy(LLM(model, device="cpu", num_gpu_blocks_override=64, block_size=8), PROMPTS, 12, logprobs=None)
    script = tmp_path / "rank0.py"
    script.write_text(RANK0)
    port = free_port()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    # Node 1 first, with arguments rank 0 never sees: it must wait for, and obey, rank 0.
    node1 = subprocess.Popen(torchrun(1, port, "-m", "pagedserve.entrypoints.cli", "generate", "ignored prompt",
                                      "--model", model, "--tensor-parallel-size", "2"),
                             env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    node0 = subprocess.Popen(torchrun(0, port, str(script), model, os.path.dirname(__file__)),
                             env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out, err = node0.communicate(timeout=240)
        assert node0.returncode == 0, err[-3000:]
        out1, err1 = node1.communicate(timeout=60)
        assert node1.returncode == 0, err1[-3000:]
    finally:
        for p in (node0, node1):
            if p.poll() is None:
                p.kill()
                p.wait()
    line = next(ln for ln in out.splitlines() if ln.startswith("TOKENS "))
    assert json.loads(line[len("TOKENS "):]) == ref
    threads = next(ln for ln in out.splitlines() if ln.startswith("GLOO_THREADS "))
    assert json.loads(threads[len("GLOO_THREADS "):]) == []
    assert "->" not in out1  # the worker never ran a `generate` of its own
