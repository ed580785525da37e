"""Decode CUDA-graph batch sizes: vLLM's default list, the cuda_graph_sizes override (config,
CLI flag, bad values), and that a batch pads to the next captured size or runs eagerly above the
largest. The GPU case checks greedy tokens against HF with a size list that leaves most batches
padded and some eager."""
import pytest
import torch

from pagedserve import SamplingParams
from pagedserve.config import EngineConfig
from pagedserve.entrypoints.cli import build_parser
from pagedserve.engine_args import engine_config_from_args
from pagedserve.runner.cuda_graph import DecodeCUDAGraphs, batch_buckets

from tests.engine.helpers import hf_greedy, make_llm, prompt_ids


def test_default_sizes_are_vllms():
    # vLLM: [1, 2, 4] + range(8, 256, 8) + range(256, max, 16)
    assert batch_buckets(20) == [1, 2, 4, 8, 16, 20]
    assert batch_buckets(256) == [1, 2, 4] + list(range(8, 257, 8))
    big = batch_buckets(1024)
    assert big[:4] == [1, 2, 4, 8] and 24 in big and 264 not in big and 272 in big and big[-1] == 1024
    assert all(b - a == 16 for a, b in zip(big[big.index(256):], big[big.index(256) + 1:]))
    assert batch_buckets(300)[-3:] == [272, 288, 300]  # max_num_seqs itself is always captured


def test_given_sizes_are_sorted_and_capped():
    assert batch_buckets(64, [32, 1, 8, 8, 128]) == [1, 8, 32]
    assert batch_buckets(4, [8, 16]) == []


def test_a_batch_pads_to_the_next_size_and_none_above_the_largest():
    graphs = DecodeCUDAGraphs(None, [], batch_buckets(64, [1, 8, 32]), max_model_len=64, block_size=16,
                              device=torch.device("cpu"))
    assert [graphs.bucket_for(b) for b in (1, 2, 8, 9, 32, 33)] == [1, 8, 8, 32, 32, None]


def test_flag_parses_to_a_list():
    args = build_parser().parse_args(["serve", "--model", "m", "--cuda-graph-sizes", "1", "8", "24"])
    assert engine_config_from_args(args, "m").cuda_graph_sizes == [1, 8, 24]


@pytest.mark.parametrize("bad", [[], [0, 8], [8, -1]])
def test_bad_sizes_name_the_field(bad):
    with pytest.raises(ValueError, match="cuda_graph_sizes"):
        EngineConfig(model="m", cuda_graph_sizes=bad)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_padded_and_eager_batches_match_hf(tiny_model_dir):
    model_dir = tiny_model_dir("llama")
    prompts = prompt_ids(model_dir)
    llm = make_llm(model_dir, device="cuda", max_num_seqs=16, cuda_graph_sizes=[1, 3])
    assert llm.llm_engine.runner.graphs.buckets == [1, 3]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True), use_tqdm=False)
    for p, o in zip(prompts, outs):
        assert o.outputs[0].token_ids == hf_greedy(model_dir, p, 16, ignore_eos=True)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_balanced_split_graphs_all_match_hf(tiny_model_dir, monkeypatch):
    """With balanced decode splits each bucket has a graph per split mode (none, the plan's rows'
    grid, and where it gives a sequence more splits its slots' grid); whichever a step replays,
    greedy tokens equal HF's. The pick cycles so that every mode runs at every size."""
    from pagedserve.attention import decode_plan

    monkeypatch.setattr(decode_plan, "decode_split_tokens", lambda: decode_plan.BALANCED)
    model_dir = tiny_model_dir("llama", max_position_embeddings=65536)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(5, 100, (n,), generator=gen).tolist() for n in (700, 3, 90, 260, 1, 1500, 40)]
    llm = make_llm(model_dir, device="cuda", max_num_seqs=16, cuda_graph_sizes=[1, 16], max_model_len=65536)
    graphs = llm.llm_engine.runner.graphs
    # one row: the base is already the whole grid, so no cut to choose
    assert set(graphs.graphs) == {(1, 0)} | {(16, m) for m in (0, decode_plan.BALANCED, decode_plan.SLOTS)}
    # at 16 rows of the tiny model's 2 KV heads the rows' grid is wider than the base (13 of 33), and
    # the slots' wider still (64); 65,536 positions are long enough for the slots' to gain (512 tiles)
    cuda = torch.device("cuda")
    assert decode_plan.decode_launch(16, 2, 65536, cuda, split_tokens=decode_plan.BALANCED) == \
        (13, 33, decode_plan.BALANCED)
    assert decode_plan.decode_launch(16, 2, 65536, cuda, split_tokens=decode_plan.SLOTS) == \
        (13, 64, decode_plan.SLOTS)
    picked = []

    def cycle(seq_lens, bucket, *args, **kwargs):
        choices = graphs.split_modes[bucket]
        picked.append(choices[len(picked) % len(choices)])
        return picked[-1]
    graphs.pick_split_mode = cycle
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True), use_tqdm=False)
    assert set(picked) == {0, decode_plan.BALANCED, decode_plan.SLOTS}
    for p, o in zip(prompts, outs):
        assert o.outputs[0].token_ids == hf_greedy(model_dir, p, 16, ignore_eos=True)
