"""ModelRunner.release_cuda_graphs: every captured graph is destroyed (tensor parallelism's NCCL
teardown waits for exactly that), and the runner keeps working eagerly afterwards."""
from types import SimpleNamespace

import pytest
import torch

from pagedserve.config import EngineConfig
from pagedserve.core.plan import SchedulerOutput
from pagedserve.models.loader import load_hf_config
from pagedserve.runner.model_runner import ModelRunner
from paged_harness import HandDriver


class FakeGraph:
    def __init__(self):
        self.resets = 0

    def reset(self):
        self.resets += 1


def test_release_resets_decode_and_piecewise_graphs():
    runner = ModelRunner.__new__(ModelRunner)  # only the graph holders matter here
    runner.device = torch.device("cpu")
    decode = {b: FakeGraph() for b in (1, 2, 4)}
    pieces = {16: [FakeGraph(), FakeGraph()], 32: [FakeGraph()]}
    full = {16: FakeGraph(), 64: FakeGraph()}
    runner.graphs = SimpleNamespace(graphs=decode)
    runner.piecewise = SimpleNamespace(pieces=pieces)
    runner.full_graphs = SimpleNamespace(graphs=full)
    assert runner.release_cuda_graphs() == 8
    assert [g.resets for g in decode.values()] == [1, 1, 1]
    assert [g.resets for p in pieces.values() for g in p] == [1, 1, 1]
    assert [g.resets for g in full.values()] == [1, 1]
    assert runner.graphs is None and runner.piecewise is None and runner.full_graphs is None
    assert runner.release_cuda_graphs() == 0  # idempotent


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_decode_after_release_matches_graph_replay(tiny_model_dir):
    model_dir = tiny_model_dir("llama")
    cfg = EngineConfig(model=str(model_dir), block_size=16, swap_space=0.01, max_num_seqs=8, dtype="float32")
    runner = ModelRunner(cfg, load_hf_config(model_dir), torch.device("cuda"), torch.float32)
    runner.load_model()
    runner.init_kv_cache(64, 4)
    assert runner.graphs is not None and runner.graphs.graphs
    d = HandDriver(runner, seed=0)
    seqs = [d.add(p) for p in ([5, 17, 33], list(range(3, 30)))]
    d.step([d.schedule(s) for s in seqs])  # prefill
    # The same decode step twice (it rewrites the same KV slots): replayed from a graph, then eagerly.
    graph_logits = runner.execute(SchedulerOutput(scheduled=[d.schedule(s) for s in seqs])).clone()
    assert runner.release_cuda_graphs() > 0
    eager_logits = runner.execute(SchedulerOutput(scheduled=[d.schedule(s) for s in seqs]))
    torch.testing.assert_close(eager_logits, graph_logits, rtol=1e-4, atol=1e-4)
