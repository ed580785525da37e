"""Nano-batched decode steps through the engine (config nano_batch_rows): greedy tokens equal HF's,
eagerly on a CPU, and on CUDA in decode graphs captured as two nano-batches on two streams (with
and without an SM carveout for the matmuls) and eagerly with the side stream."""
import pytest
import torch

from pagedserve import SamplingParams
from pagedserve.models import nano_batches
from pagedserve.models.nano_batches import NANO_PRIORITY_ENV, half_rows, nano_priority
from pagedserve.runner.cuda_graph import DecodeCUDAGraphs

from tests.engine.helpers import hf_greedy, make_llm, prompt_ids

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _greedy_matches_hf(model_dir, llm, max_tokens: int = 12):
    prompts = prompt_ids(model_dir)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True), use_tqdm=False)
    assert len(prompts) >= 4  # so that the decode steps have rows for both halves
    for p, o in zip(prompts, outs):
        assert o.outputs[0].token_ids == hf_greedy(model_dir, p, max_tokens, ignore_eos=True)


def _spy_on_halves(monkeypatch) -> list:
    """The row counts of each nano-batched forward's two halves, as they run."""
    halves = []
    forward = nano_batches.forward_nano_batches

    def spy(model, input_ids, positions, kv_caches, metas, streams):
        halves.append(tuple(m.num_seqs for m in metas))
        return forward(model, input_ids, positions, kv_caches, metas, streams)
    monkeypatch.setattr(nano_batches, "forward_nano_batches", spy)
    return halves


def test_engine_on_cpu(tiny_model_dir, monkeypatch):
    model_dir = tiny_model_dir("llama")
    llm = make_llm(model_dir, nano_batch_rows=2)
    halves = _spy_on_halves(monkeypatch)
    _greedy_matches_hf(model_dir, llm)
    n = len(prompt_ids(model_dir))
    assert (half_rows(n), n - half_rows(n)) in halves


def test_graph_buckets_forward_as_nano_batches(tiny_model_dir, monkeypatch):
    """The graphs' forward of a nano-batched bucket (what capture records) on a CPU: the same hidden
    states as the model's forward over the bucket's buffers, computed in halves of 2 and 4 rows
    (models/nano_batches.half_rows: the second half 16-byte aligned)."""
    halves = _spy_on_halves(monkeypatch)
    llm = make_llm(tiny_model_dir("llama"))
    runner = llm.llm_engine.runner
    graphs = DecodeCUDAGraphs(runner.model, runner.kv_caches, [2, 6], max_model_len=64, block_size=16,
                              device=torch.device("cpu"), nano_batch_rows=4)
    assert graphs.nano == {6} and graphs.nano_streams is None
    gen = torch.Generator().manual_seed(0)
    graphs.input_ids.copy_(torch.randint(3, 300, (6,), generator=gen))
    graphs.seq_lens.copy_(torch.tensor([5, 17, 1, 30, 9, 2], dtype=torch.int32))
    graphs.positions.copy_(graphs.seq_lens.long() - 1)
    graphs.block_tables[:, :2].copy_(torch.arange(12, dtype=torch.int32).view(6, 2))
    pos = graphs.positions
    block = graphs.block_tables.gather(1, (pos // 16)[:, None]).squeeze(1).long()
    graphs.slot_mapping.copy_(block * 16 + pos % 16)  # each row's new token where its table puts it
    with torch.inference_mode():
        expected = runner.model(graphs.input_ids, graphs.positions, runner.kv_caches, graphs._meta(6, None))
        got = graphs._forward(6, None)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    assert halves == [(2, 4)]
    assert graphs._rows_per_launch(6) == 2  # the split modes are sized for the first half's launch


@needs_cuda
@pytest.mark.parametrize("carveout,priority", [(0, "side"), (16, "side"), (0, "main"), (0, "equal")])
def test_cuda_graphs_match_hf(tiny_model_dir, monkeypatch, carveout, priority):
    monkeypatch.setenv(NANO_PRIORITY_ENV, priority)
    model_dir = tiny_model_dir("llama")
    llm = make_llm(model_dir, device="cuda", max_num_seqs=16, cuda_graph_sizes=[1, 4, 16], nano_batch_rows=4,
                   nano_batch_sm_carveout=carveout)
    graphs = llm.llm_engine.runner.graphs
    assert graphs.nano == {4, 16} and (graphs.nano_streams.main is not None) == (priority == "main")
    _greedy_matches_hf(model_dir, llm)


@needs_cuda
@pytest.mark.parametrize("priority", ["side", "main"])
def test_cuda_eager_on_two_streams_matches_hf(tiny_model_dir, monkeypatch, priority):
    monkeypatch.setenv(NANO_PRIORITY_ENV, priority)
    model_dir = tiny_model_dir("llama")
    llm = make_llm(model_dir, device="cuda", enforce_eager=True, nano_batch_rows=2)
    _greedy_matches_hf(model_dir, llm)
    assert llm.llm_engine.runner.nano_streams is not None


def test_priority_switch(monkeypatch):
    assert nano_priority() == "side"
    for mode in ("main", "equal", "side"):
        monkeypatch.setenv(NANO_PRIORITY_ENV, mode)
        assert nano_priority() == mode
    monkeypatch.setenv(NANO_PRIORITY_ENV, "attention")
    with pytest.raises(ValueError, match=NANO_PRIORITY_ENV):
        nano_priority()
